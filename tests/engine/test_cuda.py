"""The CUDA/NCCL path: our module against torch's DDP over NCCL, for every registered hook.

Marked ``cuda``; skipped, with the reason, where there are no GPUs (NCCL needs one GPU per rank: 2-rank
tests need 2 GPUs). None of these has run yet: see docs/engine.md ("CUDA and NCCL") for what has and has
not been run on GPUs. The stream helpers' CPU behaviour (no-ops) is checked everywhere.

What the GPU tests check, beyond the CPU oracle tests:
- every registered hook (inline ones, and the PowerSGD hooks that run on the communication thread) gives
  torch's results over NCCL, step by step, with several buckets in flight;
- gradients produced on two different CUDA streams are copied into one bucket correctly (each on its own
  stream, the launch stream waiting for the other), compared with the same model without any wrapper;
- Lightning's sync_batchnorm=True trains like strategy="ddp" on 2 GPUs;
- one GPU, NCCL with world size 1 (NCCL's own futures and streams): every hook against torch's DDP, on the
  default stream and with forward and backward under a side stream, each hook's result produced late on
  another stream (the stream risk of results handed over by the communication thread); the optimizer
  overlap; torch.compile; Lightning's Trainer(accelerator="gpu", devices=1) with "ddpx" against "ddp" in
  32-true, 16-mixed (its GradScaler) and bf16-mixed.

``bash scripts/gpu_check.sh`` runs every test here and the GPU benchmark (docs/engine.md, "CUDA and NCCL").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post_local
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import lightning_ddpx
from lightning_ddpx.engine.buckets.grad_bucket import collectives_issued_on_call, issues_collectives_on_call
from lightning_ddpx.engine.transport import launcher
from lightning_ddpx.engine.transport.cuda_streams import (
    comm_thread_stream,
    current_stream,
    result_future,
    stream_scope,
    wait_streams,
)
from lightning_ddpx.hooks import PowerSGDOptions, available_hooks, build_comm_hook
from tests.dist_utils import run_distributed

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int) -> pytest.MarkDecorator:
    reason = f"needs {count} CUDA GPU(s) and NCCL (one GPU per rank); this machine has {GPUS}"
    return pytest.mark.skipif(GPUS < count or not dist.is_nccl_available(), reason=reason)


STEPS = 6
START = 2  # PowerSGD's first compressed step
SMALL_BUCKETS = {"bucket_cap_mb": 0.01, "first_bucket_cap_mb": 0.002}
ONE_BUCKET = {"bucket_cap_mb": 100.0, "first_bucket_cap_mb": 100.0}
POWERSGD = dict(start_powerSGD_iter=START, matrix_approximation_rank=2)


def _torch_batched_powersgd() -> tuple[Any, Callable]:
    # torch 2.13's batched hook hands 2-D matrices to its 3-D-only _orthogonalize (see test_hooks_oracle.py).
    # Patched for the rest of this worker process, not around the hook call: on CUDA the hook's second
    # half runs later, in a callback of its allreduce, after the hook has returned.
    original = torch_powersgd._orthogonalize
    if not getattr(original, "accepts_2d", False):

        def orthogonalize(m: torch.Tensor, epsilon: float = 0) -> Any:
            return original(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)

        orthogonalize.accepts_2d = True  # type: ignore[attr-defined]
        torch_powersgd._orthogonalize = orthogonalize
    return torch_powersgd.PowerSGDState(None, **POWERSGD), torch_powersgd.batched_powerSGD_hook


# name -> (our construction kwargs, torch's (state, hook), torch's DDP kwargs, rtol, atol)
HOOK_PAIRS: dict[str, tuple[dict, Callable[[], tuple[Any, Callable]], dict, float, float]] = {
    "allreduce": (SMALL_BUCKETS, lambda: (None, torch_default.allreduce_hook), {}, 1e-6, 1e-7),
    "fp16": (SMALL_BUCKETS, lambda: (None, torch_default.fp16_compress_hook), {}, 1e-3, 1e-4),
    "bf16": (SMALL_BUCKETS, lambda: (None, torch_default.bf16_compress_hook), {}, 1e-2, 1e-3),
    "noop": (SMALL_BUCKETS, lambda: (None, debugging_hooks.noop_hook), {}, 0.0, 0.0),
    # DiLoCo's gradient hook hands the local gradients back, as torch's noop hook does (its outer step runs
    # after the optimizer step, outside the module: tests/hooks/test_diloco_oracle.py)
    "diloco": (SMALL_BUCKETS, lambda: (None, debugging_hooks.noop_hook), {}, 0.0, 0.0),
    "powersgd": (
        ONE_BUCKET,
        lambda: (torch_powersgd.PowerSGDState(None, **POWERSGD), torch_powersgd.powerSGD_hook),
        {"bucket_cap_mb": 100.0},
        1e-5,
        1e-6,
    ),
    "batched_powersgd": (ONE_BUCKET, _torch_batched_powersgd, {"bucket_cap_mb": 100.0}, 1e-5, 1e-6),
    # Both default subgroups are the ranks on this machine (torch: its GPU count), so local SGD is plain DDP
    # here; the hook's switch at START and its bookkeeping are what this compares (no model averaging).
    "post_local_sgd": (
        SMALL_BUCKETS,
        lambda: (
            torch_post_local.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=START),
            torch_post_local.post_localSGD_hook,
        ),
        {},
        1e-6,
        1e-7,
    ),
}
POST_LOCAL_SGD = {"start_localSGD_iter": START, "period": 1}


# ---------------------------------------------------------------------------------------- everywhere
def test_every_registered_hook_has_a_cuda_oracle():
    assert sorted(HOOK_PAIRS) == sorted(available_hooks())


def test_stream_helpers_are_no_ops_off_cuda():
    cpu = torch.device("cpu")
    assert current_stream(cpu) is None
    wait_streams(None, [None])  # nothing to wait on, nothing raised
    assert comm_thread_stream(cpu) is None
    with stream_scope(None):
        pass
    future = result_future(cpu)  # a plain future: no CUDA events
    future.set_result(torch.ones(2))
    assert future.wait().tolist() == [1.0, 1.0]


def test_the_communication_thread_hands_results_over_on_its_own_stream(monkeypatch):
    """The launcher's CUDA plumbing, with the stream seams replaced by recorders (no GPU needed): the thread
    asks for its stream once, for the launcher's device; the hook is called, its future waited for and the
    handed-over future completed all inside that stream's scope (so the event recorded by ``set_result``
    follows the result), the hook itself with the stream it was submitted with made current inside that; the
    handed-over future is the one made for the device."""
    log: list[tuple[str, ...]] = []
    stream, launch_stream = "the thread's stream", "the bucket's launch stream"

    @contextlib.contextmanager
    def scope(s: Any) -> Iterator[None]:
        log.append(("enter", s))
        yield
        log.append(("exit", s))

    class HookFuture(torch.futures.Future):
        def wait(self) -> Any:
            log.append(("hook future waited", threading.current_thread().name))
            return super().wait()

    class HandedOver(torch.futures.Future):
        def set_result(self, result: Any) -> None:
            log.append(("result handed over", threading.current_thread().name))
            super().set_result(result)

    made: list[torch.device] = []

    def result_future_for(device: torch.device) -> torch.futures.Future:
        made.append(device)
        return HandedOver()

    def thread_stream(device: torch.device) -> str:
        log.append(("thread stream", str(device), threading.current_thread().name))
        return stream

    monkeypatch.setattr(launcher, "comm_thread_stream", thread_stream)
    monkeypatch.setattr(launcher, "stream_scope", scope)
    monkeypatch.setattr(launcher, "result_future", result_future_for)

    def task() -> torch.futures.Future:
        log.append(("hook called",))
        future = HookFuture()
        future.set_result(torch.full((2,), 3.0))
        return future

    device = torch.device("meta")  # any device: only passed through to the seams
    sequenced = launcher.SequencedLauncher(name="test-stream-handover", device=device)
    try:
        results = [sequenced.submit(task, stream=launch_stream) for _ in range(2)]
        assert [r.wait().tolist() for r in results] == [[3.0, 3.0]] * 2
    finally:
        assert sequenced.close(timeout=10)
    assert made == [device, device]
    assert log[0] == ("thread stream", "meta", "test-stream-handover")
    thread = "test-stream-handover"
    one_task = [
        ("enter", stream),
        ("enter", launch_stream),
        ("hook called",),
        ("exit", launch_stream),
        ("hook future waited", thread),
        ("result handed over", thread),
        ("exit", stream),
    ]
    assert log[1:] == one_task * 2


def test_the_reducer_gives_the_communication_thread_its_device(monkeypatch):
    """A hook run on the communication thread gets a launcher for the parameters' device (whose futures
    carry CUDA events on a GPU), and the results still arrive (one rank: the gradients themselves)."""
    from lightning_ddpx.engine.transport import transports as transport_module
    from tests.dist_utils import one_rank_group

    devices: list[torch.device | None] = []

    class Recording(launcher.SequencedLauncher):
        def __init__(self, name: str = "lightning_ddpx-comm", device: torch.device | None = None) -> None:
            devices.append(device)
            super().__init__(name, device)

    monkeypatch.setattr(transport_module, "SequencedLauncher", Recording)

    def chained(state: Any, bucket: Any) -> torch.futures.Future:  # not marked: runs on the thread
        group = state
        return (
            dist.all_reduce(bucket.buffer(), group=group, async_op=True)
            .get_future()
            .then(lambda f: f.value()[0])
        )

    with one_rank_group():
        torch.manual_seed(0)
        plain = nn.Linear(4, 3)
        ddp = lightning_ddpx.DistributedDataParallel(copy.deepcopy(plain))
        ddp.register_comm_hook(ddp.process_group, chained)
        x = torch.randn(5, 4)
        for model in (plain, ddp):
            model(x).pow(2).sum().backward()
        for a, b in zip(plain.parameters(), ddp.module.parameters()):
            torch.testing.assert_close(b.grad, a.grad)
        ddp.close()
    assert devices == [torch.device("cpu")]


# ------------------------------------------------------------------------------------------ on GPUs
def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4),
    )  # fmt: skip


def conv_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = (torch.randn(4, 3, 12, 12, generator=generator) * (rank + 1)).cuda()
    return model(x).pow(2).mean() * (rank + 1)


def _init_nccl(rank: int, world_size: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )


def _train_pair(rank: int, name: str, device_index: int | None = None, side_stream: bool = False) -> None:
    """Our module with hook ``name`` against torch's DDP with torch's hook, gradients compared every step.

    ``side_stream``: forward, backward and step run under a side stream (not the default one), and both
    hooks' results come late, on another stream (:func:`late_doubled`)."""
    ours_kwargs, torch_hook, torch_kwargs, rtol, atol = HOOK_PAIRS[name]
    torch.manual_seed(0)
    base = convnet().cuda()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **ours_kwargs)
    powersgd = PowerSGDOptions(**POWERSGD) if "powersgd" in name else None
    post_local_sgd = POST_LOCAL_SGD if name == "post_local_sgd" else None
    state, hook = build_comm_hook(
        name, process_group=ours.process_group, powersgd=powersgd, post_local_sgd=post_local_sgd
    )
    ours.register_comm_hook(state, late_doubled(hook) if side_stream else hook)
    theirs = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), device_ids=[rank if device_index is None else device_index], **torch_kwargs
    )
    torch_state, torch_hook_fn = torch_hook()
    theirs.register_comm_hook(torch_state, late_doubled(torch_hook_fn) if side_stream else torch_hook_fn)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.02) for m in (ours, theirs)]
    stream = torch.cuda.Stream() if side_stream else None
    for step in range(STEPS):
        for model, optimizer in zip((ours, theirs), optimizers):
            with on_side_stream(stream):
                optimizer.zero_grad()
                conv_loss(model, rank, step).backward()
        torch.cuda.synchronize()  # compare finished values: a missing stream order shows as wrong ones
        for (param_name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
            where = f"{name} rank {rank} step {step} {param_name}"
            torch.testing.assert_close(
                a.grad, b.grad, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}"
            )
        for optimizer in optimizers:
            with on_side_stream(stream):
                optimizer.step()
        with on_side_stream(stream):  # the hook's model averaging (DiLoCo, post-local SGD; else nothing)
            ours.average_parameters_after_step()
    ours.close()


@contextlib.contextmanager
def on_side_stream(stream: "torch.cuda.Stream | None") -> Iterator[None]:
    """Run the block with ``stream`` current, ordered after the caller's stream and before its next work, as
    a user's ``with torch.cuda.stream(s):`` around a training step would be; nothing for ``None``."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    caller.wait_stream(stream)


# GPU cycles a late result spins for (about 10 ms on a 2 GHz clock): far longer than the write-back takes
LATE_CYCLES = 20_000_000


def late_doubled(hook: Callable) -> Callable:
    """``hook`` with its result coming late and doubled: a callback, on the fresh stream torch runs a CUDA
    future's ``then`` callbacks on, spins the GPU, then writes twice the result into a new tensor. A
    consumer not ordered after the future's CUDA events reads that tensor before it is written. Applied to
    both modules alike (gradients: twice torch's); keeps the inline/sequenced choice of ``hook``."""

    @functools.wraps(hook)
    def wrapped(state: Any, bucket: Any) -> torch.futures.Future:
        def late(future: torch.futures.Future) -> torch.Tensor:
            value = future.value()
            tensor = value[0] if isinstance(value, (list, tuple)) else value
            torch.cuda._sleep(LATE_CYCLES)
            return tensor * 2

        return hook(state, bucket).then(late)

    if issues_collectives_on_call(hook):
        collectives_issued_on_call(wrapped)
    return wrapped


def run_hooks_over_nccl(rank: int, world_size: int) -> dict[str, str]:
    _init_nccl(rank, world_size)
    return _each_hook(rank, sorted(HOOK_PAIRS))


def _each_hook(rank: int, names: list[str], device_index: int | None = None) -> dict[str, str]:
    """``_train_pair`` for every hook in ``names``: "ok" or the traceback, per hook; then leave the group."""
    out = {}
    try:
        for name in names:
            try:
                _train_pair(rank, name, device_index)
                out[name] = "ok"
            except Exception:  # noqa: BLE001 - reported by the test, per hook
                out[name] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def nccl_results() -> list[dict[str, str]]:
    return run_distributed(run_hooks_over_nccl, 2, init_process_group=False, timeout=300)


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.parametrize("name", sorted(HOOK_PAIRS))
@pytest.mark.processes
def test_hook_matches_torch_ddp_over_nccl(nccl_results, name):
    for rank, out in enumerate(nccl_results):
        assert out[name] == "ok", f"rank {rank}:\n{out[name]}"


# torch's default post-local SGD subgroup is sized by the GPU count (1 here: each rank alone), ours by host
# (both ranks): not the same algorithm on one shared GPU, so that pair runs on the NCCL test only.
ONE_GPU_HOOKS = [name for name in sorted(HOOK_PAIRS) if name != "post_local_sgd"]


def _init_gloo_on_one_gpu(rank: int, world_size: int) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )


def run_hooks_over_gloo_on_one_gpu(rank: int, world_size: int) -> dict[str, str]:
    """Both ranks on cuda:0 over gloo (NCCL refuses two ranks on one GPU): our CUDA path -- bucket copies,
    hook launch and result waits on streams -- against torch's DDP on the same devices and backend."""
    _init_gloo_on_one_gpu(rank, world_size)
    checks: dict[str, Callable[[], None]] = {}
    for name in ONE_GPU_HOOKS:
        checks[name] = functools.partial(_train_pair, rank, name, 0)
        checks[f"{name} on a side stream"] = functools.partial(_train_pair, rank, name, 0, side_stream=True)
    return _each_check(checks)


@pytest.fixture(scope="module")
def one_gpu_gloo_results() -> list[dict[str, str]]:
    return run_distributed(run_hooks_over_gloo_on_one_gpu, 2, init_process_group=False, timeout=300)


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.parametrize("name", ONE_GPU_HOOKS)
@pytest.mark.processes
def test_hook_matches_torch_ddp_on_one_gpu_over_gloo(one_gpu_gloo_results, name):
    for rank, out in enumerate(one_gpu_gloo_results):
        assert out[name] == "ok", f"rank {rank}:\n{out[name]}"


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.parametrize("name", ONE_GPU_HOOKS)
@pytest.mark.processes
def test_backward_on_a_side_stream_on_one_gpu_over_gloo(one_gpu_gloo_results, name):
    """As test_backward_on_a_side_stream_with_late_results, with two ranks exchanging through gloo."""
    key = f"{name} on a side stream"
    for rank, out in enumerate(one_gpu_gloo_results):
        assert out[key] == "ok", f"rank {rank}:\n{out[key]}"


class TwoStreams(nn.Module):
    """Two branches computed on two side streams: their gradients are produced on different streams and
    land in one bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        caller = torch.cuda.current_stream()
        for layer, stream in zip((self.a, self.b), self.streams):
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                y = layer(x)
                for _ in range(20):  # enough work that an unordered copy would read unfinished gradients
                    y = torch.tanh(y @ layer.weight.t())
            caller.wait_stream(stream)
            outputs.append(y)
        return outputs[0] + outputs[1]


def run_two_streams(rank: int, world_size: int) -> dict[str, Any]:
    _init_nccl(rank, world_size)
    try:
        torch.manual_seed(0)
        plain = TwoStreams().cuda()
        twin = TwoStreams().cuda()  # its own streams (a Stream cannot be deep-copied), rank 0's weights
        twin.load_state_dict(plain.state_dict())
        wrapped = lightning_ddpx.DistributedDataParallel(twin, **ONE_BUCKET)
        x = torch.randn(64, 256, device="cuda")
        for model in (plain, wrapped):
            model(x).pow(2).mean().backward()
        torch.cuda.synchronize()
        return {
            name: (p.grad.cpu(), q.grad.cpu())
            for (name, p), q in zip(plain.named_parameters(), wrapped.module.parameters())
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.processes
def test_gradients_from_two_streams_in_one_bucket():
    """One rank (world size 1: the average is the rank's own gradient, so it must equal the plain model's)."""
    (grads,) = run_distributed(run_two_streams, 1, init_process_group=False, timeout=120)
    for name, (expected, got) in grads.items():
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def run_sync_batchnorm(rank: int, world_size: int) -> dict[str, Any]:
    from tests.engine.test_ddp_features import WithBatchNorm, state_of
    from tests.strategy_helpers import fit, quiet

    quiet()
    out = {}
    for name in ("ddp", "ddpx"):
        _, model = fit(name, max_steps=4, model_cls=WithBatchNorm, sync_batchnorm=True, accelerator="gpu")
        out[name] = {k: v.cpu() for k, v in state_of(model).items()}
    return out


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.processes
def test_sync_batchnorm_matches_ddp_on_gpus():
    results = run_distributed(run_sync_batchnorm, 2, init_process_group=False, timeout=300)
    for out in results:
        torch.testing.assert_close(out["ddpx"], out["ddp"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        results[0]["ddpx"]["net.1.running_mean"], results[1]["ddpx"]["net.1.running_mean"]
    )


# ------------------------------------------------------------------------ one GPU, NCCL world size 1
def _each_check(checks: dict[str, Callable[[], None]]) -> dict[str, str]:
    """Run every check: "ok" or the traceback, per name; then leave the process group."""
    out = {}
    try:
        for name, check in checks.items():
            try:
                check()
                out[name] = "ok"
            except Exception:  # noqa: BLE001 - reported by the test, per check
                out[name] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    return out


def _overlap_pair(rank: int, side_stream: bool) -> None:
    """overlap_optimizer_with(AdamW) on the GPU against torch's DDP and a plain AdamW step: parameters and
    optimizer state compared every step (several buckets; AdamW's foreach kernels on CUDA)."""
    torch.manual_seed(0)
    base = convnet().cuda()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **SMALL_BUCKETS)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[rank])
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01) for m in (ours, theirs)]
    ours.overlap_optimizer_with(optimizers[0])
    # slices of long parameters are a CPU cache effect, not measured on a GPU: every parameter steps whole
    assert ours.reducer.overlap.slice_bytes is None
    stream = torch.cuda.Stream() if side_stream else None
    for step in range(STEPS):
        with on_side_stream(stream):
            for model, optimizer in zip((ours, theirs), optimizers):
                optimizer.zero_grad()
                conv_loss(model, rank, step).backward()
            optimizers[1].step()  # ours stepped in its backward
        torch.cuda.synchronize()
        for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
            where = f"overlap step {step} {name}"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
            for key, value in optimizers[0].state[a].items():
                torch.testing.assert_close(value, optimizers[1].state[b][key], rtol=1e-5, atol=1e-6)
    ours.close()


def run_one_gpu_over_nccl(rank: int, world_size: int) -> dict[str, str]:
    """World size 1 over NCCL: NCCL's own futures and streams, on the default stream and a side stream."""
    _init_nccl(rank, world_size)
    checks: dict[str, Callable[[], None]] = {}
    for name in sorted(HOOK_PAIRS):
        checks[name] = functools.partial(_train_pair, rank, name)
        checks[f"{name} on a side stream"] = functools.partial(_train_pair, rank, name, side_stream=True)
    for side_stream in (False, True):
        checks[f"overlap{' on a side stream' if side_stream else ''}"] = functools.partial(
            _overlap_pair, rank, side_stream
        )
    return _each_check(checks)


@pytest.fixture(scope="module")
def one_gpu_nccl_results() -> dict[str, str]:
    (out,) = run_distributed(run_one_gpu_over_nccl, 1, init_process_group=False, timeout=300)
    return out


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.parametrize("name", sorted(HOOK_PAIRS))
@pytest.mark.processes
def test_hook_matches_torch_ddp_over_nccl_world_size_1(one_gpu_nccl_results, name):
    assert one_gpu_nccl_results[name] == "ok", one_gpu_nccl_results[name]


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.parametrize("name", sorted(HOOK_PAIRS))
@pytest.mark.processes
def test_backward_on_a_side_stream_with_late_results(one_gpu_nccl_results, name):
    """The averaged gradients are written only after the hook's result exists, for inline hooks and for
    those run on the communication thread (PowerSGD, batched PowerSGD), with backward on a side stream."""
    key = f"{name} on a side stream"
    assert one_gpu_nccl_results[key] == "ok", one_gpu_nccl_results[key]


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.parametrize("where", ["", " on a side stream"])
@pytest.mark.processes
def test_optimizer_overlap_matches_torch_on_the_gpu(one_gpu_nccl_results, where):
    key = f"overlap{where}"
    assert one_gpu_nccl_results[key] == "ok", one_gpu_nccl_results[key]


COMPILE_MODES = ("torch_compile", "split")  # "whole" is the CPU tests' (each inductor compile costs time)


def run_compiled_on_one_gpu(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    """Eager and compiled (inductor) training of the same model over NCCL, world size 1: parameters."""
    _init_nccl(rank, world_size)
    out = {}
    try:
        for mode in ("eager", *COMPILE_MODES):
            torch.manual_seed(0)
            model = convnet().cuda()
            ddp = lightning_ddpx.DistributedDataParallel(model, **SMALL_BUCKETS)
            call: Any = ddp
            if mode == "torch_compile":
                call = torch.compile(ddp)
            elif mode in ("split", "whole"):
                lightning_ddpx.compile_model(ddp, split=mode == "split")
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
            for step in range(STEPS):
                optimizer.zero_grad()
                conv_loss(call, rank, step).backward()
                optimizer.step()
            out[mode] = [p.detach().cpu() for p in model.parameters()]
            ddp.close()
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def compiled_results() -> dict[str, list[torch.Tensor]]:
    (out,) = run_distributed(run_compiled_on_one_gpu, 1, init_process_group=False, timeout=400)
    return out


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.parametrize("mode", COMPILE_MODES)
@pytest.mark.processes
def test_torch_compile_on_the_gpu_matches_eager(compiled_results, mode):
    for k, (got, expected) in enumerate(zip(compiled_results[mode], compiled_results["eager"])):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"param {k}: {m}")


PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")


def run_trainer_on_one_gpu(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Lightning's Trainer(accelerator="gpu", devices=1) with "ddp" and "ddpx", per precision."""
    from tests.strategy_helpers import fit, quiet

    quiet()
    out = {}
    for precision in PRECISIONS:
        for name in ("ddp", "ddpx"):
            _, model = fit(name, max_steps=6, accelerator="gpu", devices=1, precision=precision)
            out[f"{precision} {name}"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def trainer_results() -> dict[str, dict[str, torch.Tensor]]:
    (out,) = run_distributed(run_trainer_on_one_gpu, 1, init_process_group=False, timeout=300)
    return out


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.processes
def test_trainer_on_one_gpu_matches_ddp(trainer_results, precision):
    """16-mixed includes Lightning's GradScaler (scaled loss, unscale, inf check) around our reducer."""
    torch.testing.assert_close(
        trainer_results[f"{precision} ddpx"], trainer_results[f"{precision} ddp"], rtol=1e-5, atol=1e-6
    )


# ------------------------------------------------------------------------- DiLoCo's quantized exchanges
@pytest.mark.cuda
@needs_gpus(1)
@pytest.mark.parametrize("count", [3, 7, 127])
def test_cudas_division_rule_is_the_one_the_cpu_tests_reproduce(count):
    """CUDA divides by a Python number (or a CPU scalar tensor) as tests/cuda_division.py says -- a product
    with the rounded reciprocal -- and by a tensor on the GPU correctly rounded, as the CPU does."""
    from lightning_ddpx.hooks.outer_exchange import divide
    from tests.cuda_division import CudaDivisionRule, correctly_rounded_quotient

    values = torch.randn(100_003, generator=torch.Generator().manual_seed(count))
    values *= torch.logspace(-30, 30, values.numel())
    with CudaDivisionRule():
        reproduced = values / count
    assert torch.equal((values.cuda() / count).cpu(), reproduced)
    assert torch.equal((values.cuda() / torch.tensor(float(count))).cpu(), reproduced)
    assert not torch.equal(reproduced, correctly_rounded_quotient(values, count))
    assert torch.equal(divide(values.cuda(), count).cpu(), correctly_rounded_quotient(values, count))


@pytest.mark.cuda
@needs_gpus(1)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_outer_deltas_are_the_same_bytes_on_the_gpu(bits):
    """Random blocks, and blocks whose scale a product with the reciprocal of qmax would round differently:
    the GPU's scales are the correctly rounded quotients, and its bytes the CPU's."""
    from lightning_ddpx.hooks.outer_exchange import BLOCK, dequantize, quantize
    from tests.cuda_division import correctly_rounded_quotient
    from tests.hooks.test_diloco_units import blocks_where_the_reciprocal_misses

    torch.manual_seed(0)
    qmax = 2 ** (bits - 1) - 1
    random = torch.randn(4, 4 * BLOCK) * torch.logspace(-6, 2, 4).view(4, 1)
    values = torch.cat([random, blocks_where_the_reciprocal_misses(qmax, 16).reshape(4, 4 * BLOCK)])
    on_cpu, on_gpu = quantize(values, bits), quantize(values.cuda(), bits)
    scales = on_gpu.cpu()[:, 4 * BLOCK * bits // 8 :].contiguous().view(torch.float32)
    amax = values.view(8, 4, BLOCK).abs().amax(dim=2)
    assert torch.equal(scales, correctly_rounded_quotient(amax, qmax))
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.equal(dequantize(on_gpu, bits, 4 * BLOCK).cpu(), dequantize(on_cpu, bits, 4 * BLOCK))


def run_quantized_exchanges_on_one_gpu(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Every rank on cuda:0 over gloo: the all-to-all and the all-gather of int8/int4 codes on CUDA tensors,
    against the same exchange of the same deltas on the CPU (three ranks: the mean's division by the world
    size has no exact reciprocal)."""
    from lightning_ddpx.hooks.outer_exchange import start_exchange

    _init_gloo_on_one_gpu(rank, world_size)
    delta = torch.randn(3000, generator=torch.Generator().manual_seed(rank)) * torch.logspace(-4, 1, 3000)
    out = {}
    for precision in ("int8", "int4"):
        for device in ("cpu", "cuda"):
            exchange = start_exchange(delta.to(device), precision, None, async_op=True, what="a test delta")
            exchange.advance()
            out[f"{precision} {device}"] = exchange.result().cpu()
    return out


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.processes
def test_quantized_outer_exchanges_on_cuda_tensors_equal_the_cpus():
    results = run_distributed(run_quantized_exchanges_on_one_gpu, 3, init_process_group=False, timeout=300)
    for precision in ("int8", "int4"):
        reference = results[0][f"{precision} cpu"]
        for out in results:
            assert torch.equal(out[f"{precision} cuda"], reference) and torch.equal(
                out[f"{precision} cpu"], reference
            )
