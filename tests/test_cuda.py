"""The CUDA/NCCL path (issue 12 part 5): our module against torch's DDP over NCCL, for every registered hook.

Marked ``cuda``; skipped, with the reason, where there are no GPUs (NCCL needs one GPU per rank: 2-rank
tests need 2 GPUs). None of these has run yet: see docs/engine.md ("CUDA and NCCL") for what has and has
not been run on GPUs. The stream helpers' CPU behaviour (no-ops) is checked everywhere.

What the GPU tests check, beyond the CPU oracle tests:
- every registered hook (inline ones, and the PowerSGD hooks that run on the communication thread) gives
  torch's results over NCCL, step by step, with several buckets in flight;
- gradients produced on two different CUDA streams are copied into one bucket correctly (each on its own
  stream, the launch stream waiting for the other), compared with the same model without any wrapper;
- Lightning's sync_batchnorm=True trains like strategy="ddp" on 2 GPUs.
"""

from __future__ import annotations

import copy
import os
import traceback
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
from lightning_ddpx.engine.cuda_streams import current_stream, on_stream, wait_streams
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
    def call() -> int:
        return 7

    assert current_stream(torch.device("cpu")) is None
    assert on_stream(None, call) is call
    wait_streams(None, [None])  # nothing to wait on, nothing raised


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


def _train_pair(rank: int, name: str, device_index: int | None = None) -> None:
    ours_kwargs, torch_hook, torch_kwargs, rtol, atol = HOOK_PAIRS[name]
    torch.manual_seed(0)
    base = convnet().cuda()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **ours_kwargs)
    powersgd = PowerSGDOptions(**POWERSGD) if "powersgd" in name else None
    post_local_sgd = POST_LOCAL_SGD if name == "post_local_sgd" else None
    ours.register_comm_hook(
        *build_comm_hook(
            name, process_group=ours.process_group, powersgd=powersgd, post_local_sgd=post_local_sgd
        )
    )
    theirs = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), device_ids=[rank if device_index is None else device_index], **torch_kwargs
    )
    theirs.register_comm_hook(*torch_hook())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.02) for m in (ours, theirs)]
    for step in range(STEPS):
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad()
            conv_loss(model, rank, step).backward()
        for (param_name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
            where = f"{name} rank {rank} step {step} {param_name}"
            torch.testing.assert_close(
                a.grad, b.grad, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}"
            )
        for optimizer in optimizers:
            optimizer.step()
    ours.close()


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
def test_hook_matches_torch_ddp_over_nccl(nccl_results, name):
    for rank, out in enumerate(nccl_results):
        assert out[name] == "ok", f"rank {rank}:\n{out[name]}"


# torch's default post-local SGD subgroup is sized by the GPU count (1 here: each rank alone), ours by host
# (both ranks): not the same algorithm on one shared GPU, so that pair runs on the NCCL test only.
ONE_GPU_HOOKS = [name for name in sorted(HOOK_PAIRS) if name != "post_local_sgd"]


def run_hooks_over_gloo_on_one_gpu(rank: int, world_size: int) -> dict[str, str]:
    """Both ranks on cuda:0 over gloo (NCCL refuses two ranks on one GPU): our CUDA path -- bucket copies,
    hook launch and result waits on streams -- against torch's DDP on the same devices and backend."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    return _each_hook(rank, ONE_GPU_HOOKS, device_index=0)


@pytest.fixture(scope="module")
def one_gpu_gloo_results() -> list[dict[str, str]]:
    return run_distributed(run_hooks_over_gloo_on_one_gpu, 2, init_process_group=False, timeout=300)


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(1)
@pytest.mark.parametrize("name", ONE_GPU_HOOKS)
def test_hook_matches_torch_ddp_on_one_gpu_over_gloo(one_gpu_gloo_results, name):
    for rank, out in enumerate(one_gpu_gloo_results):
        assert out[name] == "ok", f"rank {rank}:\n{out[name]}"


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
def test_gradients_from_two_streams_in_one_bucket():
    """One rank (world size 1: the average is the rank's own gradient, so it must equal the plain model's)."""
    (grads,) = run_distributed(run_two_streams, 1, init_process_group=False, timeout=120)
    for name, (expected, got) in grads.items():
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def run_sync_batchnorm(rank: int, world_size: int) -> dict[str, Any]:
    from tests.strategy_helpers import fit, quiet
    from tests.test_ddp_features import WithBatchNorm, state_of

    quiet()
    out = {}
    for name in ("ddp", "ddpx"):
        _, model = fit(name, max_steps=4, model_cls=WithBatchNorm, sync_batchnorm=True, accelerator="gpu")
        out[name] = {k: v.cpu() for k, v in state_of(model).items()}
    return out


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpus(2)
def test_sync_batchnorm_matches_ddp_on_gpus():
    results = run_distributed(run_sync_batchnorm, 2, init_process_group=False, timeout=300)
    for out in results:
        torch.testing.assert_close(out["ddpx"], out["ddp"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        results[0]["ddpx"]["net.1.running_mean"], results[1]["ddpx"]["net.1.running_mean"]
    )
