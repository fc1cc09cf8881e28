"""Our DistributedDataParallel against torch's, on 2 and 3 gloo ranks, step by step.

Each scenario trains both wrappers side by side (tests/oracle.py) for >= 10 SGD steps with rank-dependent
data and asserts gradients, parameters and buffers equal after every step (rtol 1e-6). Small bucket caps
force several buckets, so ordering and rebuild are exercised, not just a single allreduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import lightning_ddpx
from tests.dist_utils import run_distributed
from tests.oracle import Branches, rank_batch, set_shared_memory, train_side_by_side, wide_4mib_mlp

pytestmark = pytest.mark.processes

SMALL_BUCKETS = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001}  # ~1000 and ~250 floats
STEPS = 10


# ------------------------------------------------------------------------------------------- models
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def mlp_loss(model: nn.Module, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return model(rank_batch(rank, step, (8, 16))).pow(2).mean() * (rank + 1)


def wide() -> nn.Module:
    """Layers of 64K+ elements: the default path scales each gradient while copying it (fused)."""
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))


def wide_loss(model: nn.Module, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return model(rank_batch(rank, step, (8, 16))).pow(2).mean() * (rank + 1)


def conv_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


def conv_loss(model: nn.Module, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return model(rank_batch(rank, step, (4, 3, 10, 10))).pow(2).mean()


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.embed.requires_grad_(False)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


class Tied(nn.Module):
    """One weight used by two layers: its gradient is the sum of both uses."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 16)
        self.second.weight = self.first.weight
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.second(torch.tanh(self.first(x)))))


class Reordered(nn.Module):
    """Layers are registered a, b, c but run c, a, b: the ready order differs from the registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 4)
        self.c = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(torch.relu(self.c(x)))))


class UserGradHooks(nn.Module):
    """Each parameter carries a post-accumulate-grad hook of the user's that rescales its gradient in place
    (as a per-parameter clip would), registered on the parameters the wrapper holds, after wrapping."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _halve_gradient(param: torch.Tensor) -> None:
    assert param.grad is not None
    param.grad.mul_(0.5)


def user_hooked_loss(model: nn.Module, step: int) -> torch.Tensor:
    if step == 0:  # first call on each wrapper: hook its parameters
        for param in model.module.parameters():
            param.register_post_accumulate_grad_hook(_halve_gradient)
    return mlp_loss(model, step)


def _drop_gradient(param: torch.Tensor) -> None:
    param.grad = None


def dropping_loss(model: nn.Module, step: int) -> torch.Tensor:
    """Rank 0's hooks drop the first layer's gradients after accumulation (as an optimizer stepping in a
    hook does): torch's reducer averages zeros for them and gives them a copy of the average."""
    if step == 0 and dist.get_rank() == 0:
        for param in model.module.net[0].parameters():
            param.register_post_accumulate_grad_hook(_drop_gradient)
    return mlp_loss(model, step)


def peeking_loss(model: nn.Module, step: int) -> torch.Tensor:
    """Between the training forward and its backward, a forward with gradients disabled (a metric, an EMA)
    and, every other step, one inside no_sync(): neither cancels the training forward's synchronisation."""
    loss = mlp_loss(model, step)
    with torch.no_grad():
        mlp_loss(model, step + 1000)
    if step % 2:
        with model.no_sync():
            mlp_loss(model, step + 2000)
    return loss


def penalised_loss(model: nn.Module, step: int) -> torch.Tensor:
    """A gradient penalty (WGAN-GP, R1): torch.autograd.grad of the output with respect to the *inputs*
    runs part of the backward before the real one; it must not start or end the reduction."""
    rank = dist.get_rank()
    x = rank_batch(rank, step, (8, 16)).requires_grad_()
    out = model(x)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.pow(2).mean() * (rank + 1) + (grad_x.norm(dim=1) - 1).pow(2).mean()


# ------------------------------------------------------------------------------------------ workers
SCENARIOS = {
    "mlp": (mlp, mlp_loss, SMALL_BUCKETS, {}),
    "mlp_as_view": (mlp, mlp_loss, {**SMALL_BUCKETS, "gradient_as_bucket_view": True}, {"gradient_as_bucket_view": True}),
    "conv_bn": (conv_bn, conv_loss, SMALL_BUCKETS, {}),
    "wide": (wide, wide_loss, {"bucket_cap_mb": 0.3, "first_bucket_cap_mb": 0.05}, {}),
    "wide_unused": (wide, wide_loss, {"bucket_cap_mb": 0.3, "find_unused_parameters": True}, {"find_unused_parameters": True}),
    "branches": (Branches, mlp_loss, {**SMALL_BUCKETS, "find_unused_parameters": True}, {"find_unused_parameters": True}),
    "branches_as_view": (
        Branches, mlp_loss,
        {**SMALL_BUCKETS, "find_unused_parameters": True, "gradient_as_bucket_view": True},
        {"find_unused_parameters": True, "gradient_as_bucket_view": True},
    ),
    "frozen": (Frozen, mlp_loss, SMALL_BUCKETS, {}),
    "tied": (Tied, mlp_loss, SMALL_BUCKETS, {}),
    "reordered": (Reordered, mlp_loss, SMALL_BUCKETS, {}),
    # torch's reducer reads each gradient after the parameter's own post-accumulate-grad hooks ran
    "user_grad_hooks": (UserGradHooks, user_hooked_loss, SMALL_BUCKETS, {}),
    "user_grad_hooks_as_view": (
        UserGradHooks, user_hooked_loss,
        {**SMALL_BUCKETS, "gradient_as_bucket_view": True}, {"gradient_as_bucket_view": True},
    ),
    "peek_between_forward_and_backward": (mlp, peeking_loss, SMALL_BUCKETS, {}),
    "peek_between_forward_and_backward_unused": (
        Branches, peeking_loss, {**SMALL_BUCKETS, "find_unused_parameters": True}, {"find_unused_parameters": True},
    ),
    "gradient_penalty": (mlp, penalised_loss, SMALL_BUCKETS, {}),
    "gradient_penalty_unused": (
        Branches, penalised_loss, {**SMALL_BUCKETS, "find_unused_parameters": True}, {"find_unused_parameters": True},
    ),
    "user_drops_grads": (UserGradHooks, dropping_loss, {}, {}),
    "user_drops_grads_small_buckets": (UserGradHooks, dropping_loss, SMALL_BUCKETS, {}),
    "user_drops_grads_as_view": (
        UserGradHooks, dropping_loss, {"gradient_as_bucket_view": True}, {"gradient_as_bucket_view": True},
    ),
}  # fmt: skip


def run_scenario(rank: int, world_size: int, name: str, accumulate: int = 1) -> dict:
    build, loss_fn, ours_kwargs, torch_kwargs = SCENARIOS[name]
    return train_side_by_side(rank, build, loss_fn, STEPS, ours_kwargs, torch_kwargs, accumulate=accumulate)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_matches_torch_ddp_two_ranks(name: str) -> None:
    results = run_distributed(run_scenario, 2, name)
    assert [result["path"] for result in results] == ["shared_memory"] * 2  # two CPU ranks, one machine
    for param_name, value in results[0]["params"].items():  # replicas stay identical
        torch.testing.assert_close(value, results[1]["params"][param_name], rtol=0, atol=0)


@pytest.mark.parametrize(
    "name",
    [
        "mlp",
        "branches",
        "conv_bn",
        "wide",
        "user_grad_hooks",
        "peek_between_forward_and_backward",
        "gradient_penalty",
    ],
)
def test_matches_torch_ddp_three_ranks(name: str) -> None:
    run_distributed(run_scenario, 3, name)


@pytest.mark.parametrize("name", ["mlp", "conv_bn", "mlp_as_view"])
def test_no_sync_accumulation_matches_torch(name: str) -> None:
    run_distributed(run_scenario, 2, name, 3)


# ---------------------------------------------------- large buckets: shared memory, or one gloo all-reduce
BIG_SCENARIOS: dict[str, dict] = {
    "plain": {},  # torch's caps: one bucket at first, then 25 MiB after a 1 MiB first bucket
    "as_view": {"gradient_as_bucket_view": True},
    "find_unused": {"find_unused_parameters": True},  # torch's caps from the start, never rebuilt
    "static_graph": {"static_graph": True},
    "explicit_cap": {"bucket_cap_mb": 1},  # torch: the first bucket 1 MiB as well
}


def run_big(
    rank: int,
    world_size: int,
    name: str,
    accumulate: int = 1,
    torch_hook: bool = False,
    shared_memory: bool = True,
) -> dict:
    set_shared_memory(shared_memory)
    kwargs = BIG_SCENARIOS[name]
    hooks = (
        ((None, default_hooks.allreduce_hook), (None, default_hooks.allreduce_hook)) if torch_hook else None
    )
    # Exact at any world size: two ranks sum a + b whichever collective carries it; past two, gloo's ring sums
    # an element in an order set by its offset in the bucket, so this holds only because our buckets are
    # torch's (its construction-time layout, its caps, its rebuild), and this wide tanh network would amplify
    # any rounding difference step after step.
    return train_side_by_side(
        rank,
        wide_4mib_mlp,
        mlp_loss,
        6,
        kwargs,
        kwargs,
        hooks=hooks,
        accumulate=accumulate,
        rtol=0.0,
        atol=0.0,
    )


@pytest.mark.parametrize("name", sorted(BIG_SCENARIOS))
def test_shared_memory_sums_are_bit_identical_to_torch(name: str) -> None:
    results = run_distributed(run_big, 2, name)
    assert [result["path"] for result in results] == ["shared_memory"] * 2


@pytest.mark.parametrize("name", sorted(BIG_SCENARIOS))
def test_large_buckets_over_gloo_are_bit_identical_to_torch(name: str) -> None:
    results = run_distributed(run_big, 2, name, 1, False, False)  # shared memory off: gloo
    assert [result["path"] for result in results] == ["whole"] * 2


@pytest.mark.parametrize("name", sorted(BIG_SCENARIOS))
def test_three_ranks_are_bit_identical_to_torch(name: str) -> None:
    """Past two ranks the sums depend on the bucket layout: ours must be torch's, at construction (one bucket
    per dtype, or its caps along parameter order with find_unused_parameters), after the rebuild, and with
    an explicit bucket_cap_mb (which sizes torch's first bucket too)."""
    results = run_distributed(run_big, 3, name, 1, False, False)
    assert [result["path"] for result in results] == ["whole"] * 3


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared_memory", "gloo"])
def test_large_buckets_under_no_sync_accumulation(shared_memory: bool) -> None:
    results = run_distributed(run_big, 2, "plain", 3, False, shared_memory)
    assert [result["path"] for result in results] == ["shared_memory" if shared_memory else "whole"] * 2


def test_large_buckets_stay_whole_with_three_ranks_or_a_registered_hook() -> None:
    """Three ranks: gloo's ring would sum in another order than a + b (no shared memory); a registered hook
    must see whole buckets and run its own collectives. Both keep one gloo collective per
    bucket and match torch."""
    for result in run_distributed(run_big, 3, "plain"):
        assert result["path"] == "whole"
    for result in run_distributed(run_big, 2, "plain", 1, True):
        assert result["path"] == "whole"


def test_branch_unused_everywhere_keeps_grad_none() -> None:
    results = run_distributed(check_globally_unused, 2)
    assert results == [True, True]


def check_globally_unused(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    model = lightning_ddpx.DistributedDataParallel(Branches(), find_unused_parameters=True, **SMALL_BUCKETS)
    for step in range(3):
        model.zero_grad()
        mlp_loss(model, step).backward()
        assert model.module.never.weight.grad is None, "a parameter unused on every rank must keep grad None"
        # 'a' is used on rank 0 only, 'b' on the others: both get the averaged gradient on every rank.
        assert model.module.a.weight.grad is not None and model.module.b.weight.grad is not None
    return True


def test_rebuild_follows_observed_ready_order() -> None:
    results = run_distributed(run_scenario, 2, "reordered")
    plans = results[0]["plans"]
    # Construction plans in reverse registration order (c's tensors last); after the first iteration the
    # observed order (b, a, c) is used, so c's parameters are in the last bucket launched.
    assert plans[1] == plans[-1], "buckets must be rebuilt once, then stay"
    flat = [name for bucket in plans[1] for name in bucket]
    assert flat.index("b.bias") < flat.index("a.weight") < flat.index("c.weight"), plans[1]
    assert results[0]["plans"] == results[1]["plans"], "ranks must agree on the rebuilt layout"


def count_collectives_under_no_sync(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    calls = []
    original = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        counts = []
        for step in range(4):  # step 0 runs before the rebuild
            with model.no_sync():
                mlp_loss(model, 10 * step).backward()
                mlp_loss(model, 10 * step + 1).backward()
            counts.append(("inside no_sync", len(calls)))
            calls.clear()
            mlp_loss(model, 10 * step + 2).backward()
            counts.append(("synced", len(calls)))
            calls.clear()
        return {"counts": counts, "buckets": len(model.bucket_plan())}
    finally:
        dist.all_reduce = original


def test_no_sync_issues_no_collective() -> None:
    result = run_distributed(count_collectives_under_no_sync, 2)[0]
    buckets = result["buckets"]
    assert buckets > 1
    for label, count in result["counts"]:
        if label == "inside no_sync":
            assert count == 0, result
    # After the rebuild every synced backward launches exactly one collective per bucket.
    assert [c for label, c in result["counts"][2:] if label == "synced"] == [buckets] * 3, result


# --------------------------------------------------------------------- torch's own hooks on our module
def run_torch_hook(rank: int, world_size: int, hook_name: str) -> dict:
    if hook_name == "powersgd":
        ours_state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        torch_state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        hooks = ((ours_state, powerSGD_hook.powerSGD_hook), (torch_state, powerSGD_hook.powerSGD_hook))
        single_bucket = {"bucket_cap_mb": 100.0}
        return train_side_by_side(
            rank, mlp, mlp_loss, STEPS + 2, {**single_bucket, "first_bucket_cap_mb": 100.0}, single_bucket,
            hooks=hooks, rtol=1e-5, atol=1e-6,
        )  # fmt: skip
    hook = {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        # returns a float16 tensor for a float32 bucket: the reducer casts it back, as torch's does
        "fp16_wrapper": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    }[hook_name]
    tolerance = {"allreduce": (1e-6, 1e-7), "fp16": (1e-3, 1e-4), "fp16_wrapper": (1e-3, 1e-4)}[hook_name]
    return train_side_by_side(
        rank, conv_bn, conv_loss, STEPS, SMALL_BUCKETS, {}, hooks=((None, hook), (None, hook)),
        rtol=tolerance[0], atol=tolerance[1],
    )  # fmt: skip


@pytest.mark.parametrize("hook_name", ["allreduce", "fp16", "fp16_wrapper", "powersgd"])
def test_torch_hooks_run_on_our_module(hook_name: str) -> None:
    run_distributed(run_torch_hook, 2, hook_name)


def train_torch_powersgd_many_buckets(rank: int, world_size: int) -> dict:
    """torch's PowerSGD chains allreduces from callbacks; on torch's DDP with several buckets it can abort
    with a gloo collective mismatch. Our sequenced launcher must keep one order on every rank."""
    torch.manual_seed(0)
    # ~52 and ~262 floats: one bucket per layer of mlp() (weight and bias), 3 buckets
    three_buckets = {"first_bucket_cap_mb": 0.0002, "bucket_cap_mb": 0.001}
    model = lightning_ddpx.DistributedDataParallel(mlp(), **three_buckets)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.zeros(8, 4)
    losses = []
    for step in range(30):
        optimizer.zero_grad()
        x = rank_batch(rank, step % 4, (8, 16))
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "buckets": len(model.bucket_plan()),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_torch_powersgd_with_many_buckets_keeps_collective_order() -> None:
    results = run_distributed(train_torch_powersgd_many_buckets, 2)
    assert results[0]["buckets"] >= 3
    for a, b in zip(results[0]["params"], results[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # replicas identical
    losses = results[0]["losses"]
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses
