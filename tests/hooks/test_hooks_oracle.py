"""Our hooks against torch's, on 2 and 3 gloo ranks, with rank-dependent data.

The main oracle is our hook on our ``DistributedDataParallel`` against torch's hook on torch's DDP: same
initial weights, same batches, SGD, gradients and parameters compared after every step. Each spawned job
runs several scenarios to keep the suite fast. PowerSGD comparisons use one bucket (torch's hook aborts
with a gloo collective mismatch on several CPU buckets); our PowerSGD on several buckets is checked by
training instead.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import lightning_ddpx
from lightning_ddpx import hooks
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.processes]

ONE_BUCKET = {"bucket_cap_mb": 100.0}
OUR_ONE_BUCKET = {"bucket_cap_mb": 100.0, "first_bucket_cap_mb": 100.0}
SMALL_BUCKETS = {"bucket_cap_mb": 0.01, "first_bucket_cap_mb": 0.002}  # ~2600 and ~500 floats


# ------------------------------------------------------------------------------------------- models
def convnet() -> nn.Module:
    """Conv weights (4-D) and same-shaped linear layers, so batching by shape is exercised."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(16 * 6 * 6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 4),
    )  # fmt: skip


def batch(rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Differs per rank and per step, so an unreduced gradient cannot pass for a reduced one."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=generator) * (rank + 1)


def conv_loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(batch(dist.get_rank(), step, (4, 3, 10, 10))).pow(2).mean()


def strided_convnet() -> nn.Module:
    """convnet with channels_last conv weights and one transposed linear weight: gradients stored in another
    order than row-major. torch's reducer keeps that order in the bucket, and PowerSGD's matrices are read
    from those bytes."""
    model = convnet().to(memory_format=torch.channels_last)
    model[-1].weight = nn.Parameter(
        model[-1].weight.detach().t().contiguous().t()
    )  # same values, strides (1, 32)
    assert not model[0].weight.is_contiguous() and not model[-1].weight.is_contiguous()
    return model


def complex_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8, dtype=torch.complex64), nn.Linear(8, 2, dtype=torch.complex64))


def complex_loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.complex(batch(dist.get_rank(), step, (6, 4)), batch(dist.get_rank(), step + 50, (6, 4)))
    return model(x).abs().pow(2).mean()


def regression_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def regression_loss(model: nn.Module, step: int) -> torch.Tensor:
    """A learnable target (a fixed random linear map), data cycling over 4 batches per rank."""
    x = batch(dist.get_rank(), step % 4, (16, 16))
    teacher = torch.randn(16, 8, generator=torch.Generator().manual_seed(99)) / 4
    return (model(x) - x @ teacher).pow(2).mean()


# ------------------------------------------------------------------------------------------ helpers
Wrap = Callable[[nn.Module], nn.Module]


def ours(**kwargs: Any) -> Wrap:
    return lambda module: lightning_ddpx.DistributedDataParallel(module, **kwargs)


def torchs(**kwargs: Any) -> Wrap:
    return lambda module: torch.nn.parallel.DistributedDataParallel(module, **kwargs)


def train_pair(
    build: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module, int], torch.Tensor],
    steps: int,
    a: tuple[Wrap, Any, Any],
    b: tuple[Wrap, Any, Any],
    rtol: float,
    atol: float,
    lr: float = 0.02,
    label: str = "",
) -> dict[str, Any]:
    """Train ``a = (wrap, state, hook)`` and ``b`` side by side; compare grads and params every step."""
    torch.manual_seed(0)
    base = build()
    models = []
    for wrap, state, hook in (a, b):
        model = wrap(copy.deepcopy(base))
        if hook is not None:
            model.register_comm_hook(state, hook)
        models.append(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    losses = []
    for step in range(steps):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            loss = loss_fn(model, step)
            loss.backward()
        losses.append(loss.item())
        for (name, pa), pb in zip(models[0].module.named_parameters(), models[1].module.parameters()):
            where = f"{label} rank {dist.get_rank()} step {step} {name}"
            torch.testing.assert_close(
                pa.grad, pb.grad, rtol=rtol, atol=atol, msg=lambda m, where=where: f"{where} grad: {m}"
            )
        for optimizer in optimizers:
            optimizer.step()
        for (name, pa), pb in zip(models[0].module.named_parameters(), models[1].module.parameters()):
            where = f"{label} rank {dist.get_rank()} step {step} {name}"
            torch.testing.assert_close(
                pa, pb, rtol=rtol, atol=atol, msg=lambda m, where=where: f"{where} param: {m}"
            )
    return {"params": [p.detach().clone() for p in models[0].parameters()], "losses": losses}


def local_gradients(build: Callable[[], nn.Module], loss_fn: Callable, step: int) -> list[torch.Tensor]:
    """This rank's own, unreduced gradients for ``step`` (same initial weights as train_pair)."""
    torch.manual_seed(0)
    model = build()
    loss_fn(model, step).backward()
    return [p.grad for p in model.parameters()]


# ---------------------------------------------------------------------------------- stateless hooks
def _allreduce_with_unused_option(state: Any, bucket: Any, option: int) -> torch.futures.Future:
    return hooks.allreduce_hook(state, bucket)


class _AllreduceObject:
    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future:
        return hooks.allreduce_hook(state, bucket)


def run_stateless_hooks(rank: int, world_size: int) -> dict[str, Any]:
    steps = 10
    results = {}
    results["allreduce"] = train_pair(
        convnet, conv_loss, steps, (ours(**SMALL_BUCKETS), None, hooks.allreduce_hook),
        (torchs(), None, torch_default.allreduce_hook), rtol=1e-6, atol=1e-7, label="allreduce",
    )  # fmt: skip
    if world_size > 2:
        return results
    results["fp16"] = train_pair(
        convnet, conv_loss, steps, (ours(**SMALL_BUCKETS), None, hooks.fp16_compress_hook),
        (torchs(), None, torch_default.fp16_compress_hook), rtol=1e-3, atol=1e-4, label="fp16",
    )  # fmt: skip
    # torch's DDP refuses any bf16 hook off NCCL, but torch's bf16 hook runs on our module: same maths,
    # so the same bits. And bf16 stays within its precision of the exact fp32 average.
    results["bf16"] = train_pair(
        convnet, conv_loss, steps, (ours(**SMALL_BUCKETS), None, hooks.bf16_compress_hook),
        (ours(**SMALL_BUCKETS), None, torch_default.bf16_compress_hook), rtol=0, atol=0, label="bf16",
    )  # fmt: skip
    train_pair(
        convnet, conv_loss, 3, (ours(**SMALL_BUCKETS), None, hooks.bf16_compress_hook),
        (torchs(), None, torch_default.allreduce_hook), rtol=2e-2, atol=2e-4, label="bf16 vs fp32",
    )  # fmt: skip
    for name, wrapper, hook in (
        ("fp16", hooks.fp16_compress_wrapper, hooks.fp16_compress_hook),
        ("bf16", hooks.bf16_compress_wrapper, hooks.bf16_compress_hook),
    ):
        train_pair(
            convnet, conv_loss, 4, (ours(**SMALL_BUCKETS), None, wrapper(hooks.allreduce_hook)),
            (ours(**SMALL_BUCKETS), None, hook), rtol=0, atol=0, label=f"{name} wrapper",
        )  # fmt: skip
    # Our hooks also register and run on torch's own DDP (its annotation checks pass).
    train_pair(
        convnet, conv_loss, 4, (torchs(), None, hooks.allreduce_hook),
        (torchs(), None, torch_default.allreduce_hook), rtol=0, atol=0, label="allreduce on torch DDP",
    )  # fmt: skip
    train_pair(
        convnet, conv_loss, 4, (torchs(), None, hooks.fp16_compress_wrapper(hooks.allreduce_hook)),
        (torchs(), None, torch_default.fp16_compress_hook), rtol=0, atol=0, label="fp16 wrapper on torch DDP",
    )  # fmt: skip
    # A hook given as functools.partial or as a callable object (torch's DDP refuses both: it reads the
    # hook's __qualname__) trains as the function: its name, compared across ranks, holds no address.
    for label, hook in (
        ("partial", functools.partial(_allreduce_with_unused_option, option=3)),
        ("callable object", _AllreduceObject()),
    ):
        train_pair(
            convnet, conv_loss, 4, (ours(**SMALL_BUCKETS), None, hook),
            (torchs(), None, torch_default.allreduce_hook), rtol=1e-6, atol=1e-7, label=label,
        )  # fmt: skip
    # noop: every rank keeps exactly its own gradient.
    torch.manual_seed(0)
    model = lightning_ddpx.DistributedDataParallel(convnet(), **SMALL_BUCKETS)
    model.register_comm_hook(None, hooks.noop_hook)
    conv_loss(model, 0).backward()
    for got, want in zip(model.parameters(), local_gradients(convnet, conv_loss, 0)):
        assert torch.equal(got.grad, want), "noop_hook must leave the local gradient untouched"
    results["noop_grads"] = [p.grad.clone() for p in model.parameters()]
    return results


def test_stateless_hooks_match_torch_two_ranks() -> None:
    results = run_distributed(run_stateless_hooks, 2)
    for name in ("allreduce", "fp16", "bf16"):
        for p0, p1 in zip(results[0][name]["params"], results[1][name]["params"]):
            assert torch.equal(p0, p1), f"{name}: replicas diverged"
    different = [not torch.equal(a, b) for a, b in zip(results[0]["noop_grads"], results[1]["noop_grads"])]
    assert all(different), "the data is rank dependent, so unreduced gradients must differ between ranks"


def test_allreduce_hook_matches_torch_three_ranks() -> None:
    run_distributed(run_stateless_hooks, 3)


# ------------------------------------------------------------------------------ PowerSGD vs torch's
POWERSGD_SCENARIOS = {
    "rank1": dict(matrix_approximation_rank=1),
    "rank4_batched": dict(matrix_approximation_rank=4, batch_tensors_with_same_shape=True),
    "rank2_no_memory": dict(matrix_approximation_rank=2, use_error_feedback=False, warm_start=False),
    "rank4_no_warm_start": dict(matrix_approximation_rank=4, warm_start=False),
    "rank1_no_error_feedback_batched": dict(
        matrix_approximation_rank=1, use_error_feedback=False, batch_tensors_with_same_shape=True
    ),
    "rank1_compress_vectors": dict(matrix_approximation_rank=1, min_compression_rate=0.5),
}
START = 2
POWERSGD_STEPS = START + 10


def run_powersgd_against_torch(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    results = {}
    for name in names:
        options = dict(start_powerSGD_iter=START, **POWERSGD_SCENARIOS[name])
        results[name] = train_pair(
            convnet, conv_loss, POWERSGD_STEPS,
            (ours(**OUR_ONE_BUCKET), hooks.PowerSGDState(None, **options), hooks.powersgd_hook),
            (torchs(**ONE_BUCKET), torch_powersgd.PowerSGDState(None, **options), torch_powersgd.powerSGD_hook),
            rtol=1e-5, atol=1e-6, label=name,
        )  # fmt: skip
    return results


def run_powersgd_variants_against_torch(rank: int, world_size: int) -> dict[str, Any]:
    options = dict(start_powerSGD_iter=START, matrix_approximation_rank=1)
    # Our hook on torch's DDP too (same GradBucket interface).
    train_pair(
        convnet, conv_loss, POWERSGD_STEPS,
        (torchs(**ONE_BUCKET), hooks.PowerSGDState(None, **options), hooks.powersgd_hook),
        (torchs(**ONE_BUCKET), torch_powersgd.PowerSGDState(None, **options), torch_powersgd.powerSGD_hook),
        rtol=1e-5, atol=1e-6, label="ours on torch DDP",
    )  # fmt: skip
    # Weights stored channels_last or transposed: the same bytes in the bucket as torch's, hence the same
    # matrices; torch's own hook on our module gives torch's result bit for bit.
    for name, our_hook, our_state_type in (
        ("ours", hooks.powersgd_hook, hooks.PowerSGDState),
        ("torch's hook on ours", torch_powersgd.powerSGD_hook, torch_powersgd.PowerSGDState),
    ):
        train_pair(
            strided_convnet, conv_loss, POWERSGD_STEPS,
            (ours(**OUR_ONE_BUCKET), our_state_type(None, **options), our_hook),
            (torchs(**ONE_BUCKET), torch_powersgd.PowerSGDState(None, **options), torch_powersgd.powerSGD_hook),
            rtol=1e-5 if name == "ours" else 0.0, atol=1e-6 if name == "ours" else 0.0,
            label=f"channels_last/transposed, {name}",
        )  # fmt: skip
    # Complex parameters: an all-reduce hands back the bucket viewed as pairs of reals, read back as complex.
    train_pair(
        complex_model, complex_loss, 3,
        (ours(), None, hooks.allreduce_hook), (torchs(), None, None), rtol=1e-6, atol=1e-7, label="complex",
    )  # fmt: skip
    # fp16 wrapper around PowerSGD: P and Q travel in half precision on both sides.
    train_pair(
        convnet, conv_loss, POWERSGD_STEPS,
        (ours(**OUR_ONE_BUCKET), hooks.PowerSGDState(None, **options),
         hooks.fp16_compress_wrapper(hooks.powersgd_hook)),
        (torchs(**ONE_BUCKET), torch_powersgd.PowerSGDState(None, **options),
         torch_default.fp16_compress_wrapper(torch_powersgd.powerSGD_hook)),
        rtol=1e-2, atol=1e-4, label="fp16(powersgd)",
    )  # fmt: skip
    # torch 2.13's batched_powerSGD_hook passes 2-D matrices to its own 3-D-only _orthogonalize and fails;
    # with that one call adapted it is a faithful oracle for our square-matrix hook.
    original = torch_powersgd._orthogonalize
    torch_powersgd._orthogonalize = lambda m, epsilon=0: original(
        m.unsqueeze(0) if m.dim() == 2 else m, epsilon
    )
    try:
        for name in ("rank1", "rank2_no_memory"):
            batched = dict(start_powerSGD_iter=START, **POWERSGD_SCENARIOS[name])
            train_pair(
                convnet, conv_loss, POWERSGD_STEPS,
                (ours(**OUR_ONE_BUCKET), hooks.PowerSGDState(None, **batched), hooks.batched_powersgd_hook),
                (torchs(**ONE_BUCKET), torch_powersgd.PowerSGDState(None, **batched),
                 torch_powersgd.batched_powerSGD_hook),
                rtol=1e-5, atol=1e-6, label=f"batched {name}",
            )  # fmt: skip
    finally:
        torch_powersgd._orthogonalize = original
    return {}


def test_powersgd_matches_torch_two_ranks() -> None:
    results = run_distributed(run_powersgd_against_torch, 2, sorted(POWERSGD_SCENARIOS))
    for name in POWERSGD_SCENARIOS:
        for p0, p1 in zip(results[0][name]["params"], results[1][name]["params"]):
            assert torch.equal(p0, p1), f"{name}: replicas diverged"


def test_powersgd_matches_torch_three_ranks() -> None:
    run_distributed(run_powersgd_against_torch, 3, ["rank1", "rank4_batched"])


def test_powersgd_variants_match_torch() -> None:
    run_distributed(run_powersgd_variants_against_torch, 2)


# -------------------------------------------------------------------- PowerSGD on several buckets
def train_with_hook(rank: int, world_size: int, hook_name: str, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = lightning_ddpx.DistributedDataParallel(regression_model(), **SMALL_BUCKETS)
    state, hook = hooks.build_comm_hook(
        hook_name,
        powersgd={"start_powerSGD_iter": 5, "matrix_approximation_rank": 2, "min_compression_rate": 1},
    )
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = regression_loss(model, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "buckets": len(model.bucket_plan()),
        "iter": state.iter,
        "stats": state.compression_stats(),
        "params": [p.detach().clone() for p in model.parameters()],
    }


@pytest.mark.parametrize("hook_name", ["powersgd", "batched_powersgd"])
def test_powersgd_trains_on_several_buckets_of_our_module(hook_name: str) -> None:
    steps = 40
    results = run_distributed(train_with_hook, 2, hook_name, steps)
    first = results[0]
    assert first["buckets"] >= 3, "the point is several buckets, which torch's hook cannot do on gloo"
    assert first["iter"] == steps, "the iteration counter must move once per step, not once per bucket"
    assert sorted(first["stats"].per_bucket) == list(range(first["buckets"]))
    assert first["stats"].compression_rate > 1
    for p0, p1 in zip(first["params"], results[1]["params"]):
        assert torch.equal(p0, p1), "replicas must stay identical"
    losses = first["losses"]
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses  # learns the target through compression
    assert sum(losses[-4:]) < sum(losses[6:10]), losses  # and keeps improving after compression starts


# ------------------------------------------------------------------------ checkpoint round trip
def resume_on_our_module(rank: int, world_size: int, hook_name: str) -> dict[str, Any]:
    """Train 10 steps straight, or 6 + save + load everything into fresh objects + 4: same bits."""
    import io

    options = {"start_powerSGD_iter": 3, "matrix_approximation_rank": 2, "min_compression_rate": 1}

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = lightning_ddpx.DistributedDataParallel(regression_model(), **SMALL_BUCKETS)
        state, hook = hooks.build_comm_hook(hook_name, powersgd=options)
        model.register_comm_hook(state, hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
        optimizer.zero_grad()
        regression_loss(model, i).backward()
        optimizer.step()

    model, optimizer, _ = fresh()
    for i in range(10):
        step(model, optimizer, i)
    straight = [p.detach().clone() for p in model.parameters()]

    model, optimizer, state = fresh()
    for i in range(6):
        step(model, optimizer, i)
    buffer = io.BytesIO()
    # the layout too: batched PowerSGD keys its memory by bucket, and a fresh module starts from torch's
    # construction-time buckets (one), not the rebuilt ones the memory was built for
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "hook": state.state_dict(), "layout": model.reducer_state_dict()}, buffer)  # fmt: skip
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    model, optimizer, state = fresh()
    model.module.load_state_dict(checkpoint["model"])
    model.load_reducer_state_dict(checkpoint["layout"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["hook"])
    for i in range(6, 10):
        step(model, optimizer, i)
    resumed = [p.detach().clone() for p in model.parameters()]
    return {"same": all(torch.equal(a, b) for a, b in zip(straight, resumed))}


@pytest.mark.parametrize("hook_name", ["powersgd", "batched_powersgd"])
def test_state_dict_resume_is_bit_identical_on_our_module(hook_name: str) -> None:
    results = run_distributed(resume_on_our_module, 2, hook_name)
    assert results == [{"same": True}, {"same": True}]
