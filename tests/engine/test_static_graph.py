"""``static_graph=True``: oracle tests against torch's DDP ``static_graph=True`` on 2 gloo ranks.

Every scenario trains ours and torch's side by side (tests/oracle.py) with rank-dependent data and compares
gradients, parameters and buffers after every step (rtol 1e-6). Where torch's static graph cannot run
(``no_sync`` accumulation before the first synchronised step crashes it: pytorch issue 143580) the
reference is torch's dynamic DDP with ``find_unused_parameters=True``, which computes the same gradients.
All scenarios run in ONE 2-process job; each test reads its scenario's outcome.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_ddpx
from tests.dist_utils import run_distributed
from tests.oracle import rank_batch, train_side_by_side

pytestmark = [pytest.mark.slow, pytest.mark.processes]

STEPS = 6
SMALL_BUCKETS = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001}


class WithUnused(nn.Module):
    """``never`` takes no part in forward: unused on every rank, every step."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.never = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class RankBranches(nn.Module):
    """Rank 0 uses ``left``, rank 1 ``right``: each is used on one rank only (the same every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.left, self.right = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.left(h) if dist.get_rank() == 0 else self.right(h)


class SharedCheckpointed(nn.Module):
    """``shared`` is applied twice, each time inside torch.utils.checkpoint; ``never`` is unused.

    With ``use_reentrant=True`` each checkpoint runs a nested backward, so ``shared``'s gradient hook fires
    twice per backward (torch's DDP supports this only with static_graph=True).
    """

    use_reentrant = True

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(2):
            h = torch.tanh(checkpoint(self.shared, h, use_reentrant=self.use_reentrant))
        return self.out(h)


class SharedCheckpointedNonReentrant(SharedCheckpointed):
    use_reentrant = False


class CheckpointedOnce(nn.Module):
    """Every parameter inside reentrant checkpoints, each used once: torch's dynamic DDP handles it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()  # reentrant checkpoints pass gradients only to inputs needing them
        for block in self.blocks:
            x = torch.tanh(checkpoint(block, x, use_reentrant=True))
        return x


def inplace_loss(model: nn.Module, step: int) -> torch.Tensor:
    """Forward's output modified in place before the loss (the module must not wrap its outputs)."""
    out = model(rank_batch(dist.get_rank(), step, (8, 16)))
    out.mul_(2.0)
    return out.pow(2).mean()


def loss(model: nn.Module, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return model(rank_batch(rank, step, (8, 16))).pow(2).mean() * (rank + 1)


def scenario(rank: int, build, ours: dict, theirs: dict, accumulate: int = 1) -> None:
    train_side_by_side(rank, build, loss, STEPS, {**SMALL_BUCKETS, **ours}, theirs, accumulate=accumulate)


def count_graph_walks(rank: int, **ours_kwargs) -> int:
    """Graph walks of our reducer in STEPS synchronised iterations (the module's own training loop)."""
    import lightning_ddpx.engine.reducer.reducer as reducer_module

    calls = []
    original = reducer_module.unreachable_parameter_indices

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    reducer_module.unreachable_parameter_indices = counting
    try:
        torch.manual_seed(0)
        model = lightning_ddpx.DistributedDataParallel(WithUnused(), **ours_kwargs)
        for step in range(STEPS):
            loss(model, step).backward()
    finally:
        reducer_module.unreachable_parameter_indices = original
    return len(calls)


def changed_graph(rank: int) -> str:
    """Record with ``never`` used, then stop using it: both ranks must fail with the static-graph error."""

    class Switch(WithUnused):
        use_never = True

        def forward(self, x):
            out = super().forward(x)
            return out + self.never(out) if self.use_never else out

    torch.manual_seed(0)
    model = lightning_ddpx.DistributedDataParallel(Switch(), static_graph=True)
    loss(model, 0).backward()
    model.module.use_never = False
    try:
        loss(model, 1).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def run_all(rank: int, world_size: int) -> dict:
    static = {"static_graph": True}
    scenarios = {
        "unused": lambda: scenario(rank, WithUnused, static, static),
        "unused_find_unused": lambda: scenario(
            rank,
            WithUnused,
            {**static, "find_unused_parameters": True},
            {**static, "find_unused_parameters": True},
        ),
        "unused_bucket_view": lambda: scenario(
            rank,
            WithUnused,
            {**static, "gradient_as_bucket_view": True},
            {**static, "gradient_as_bucket_view": True},
        ),
        "rank_branches": lambda: scenario(rank, RankBranches, static, static),
        "checkpoint_reentrant_shared": lambda: scenario(rank, SharedCheckpointed, static, static),
        "checkpoint_non_reentrant_shared": lambda: scenario(
            rank, SharedCheckpointedNonReentrant, static, static
        ),
        # torch's static graph crashes when no_sync runs before the first synchronised backward
        "no_sync_accumulation": lambda: scenario(
            rank, WithUnused, static, {"find_unused_parameters": True}, accumulate=3
        ),
        "no_sync_checkpointed": lambda: scenario(
            rank, SharedCheckpointedNonReentrant, static, {"find_unused_parameters": True}, accumulate=2
        ),
    }
    # Without static_graph: the reduction starts in the outermost backward (lightning_ddpx/engine/reducer/backward_start.py).
    scenarios["dynamic_checkpoint_reentrant"] = lambda: scenario(rank, CheckpointedOnce, {}, {})
    scenarios["dynamic_inplace_output"] = lambda: train_side_by_side(
        rank,
        WithUnused,
        inplace_loss,
        STEPS,
        {"find_unused_parameters": True},
        {"find_unused_parameters": True},
    )
    out: dict = {}
    for name, run in scenarios.items():
        try:
            run()
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - reported by the test of this scenario
            out[name] = traceback.format_exc()
    out["walks/static"] = count_graph_walks(rank, static_graph=True, find_unused_parameters=True)
    out["walks/dynamic"] = count_graph_walks(rank, find_unused_parameters=True)
    out["changed_graph"] = changed_graph(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(run_all, 2, timeout=300)


SCENARIOS = [
    "unused",
    "unused_find_unused",
    "unused_bucket_view",
    "rank_branches",
    "checkpoint_reentrant_shared",
    "checkpoint_non_reentrant_shared",
    "no_sync_accumulation",
    "no_sync_checkpointed",
    "dynamic_checkpoint_reentrant",
    "dynamic_inplace_output",
]


@pytest.mark.parametrize("name", SCENARIOS)
def test_static_graph_matches_torch(results, name):
    for rank, rank_out in enumerate(results):
        assert rank_out[name] == "ok", f"rank {rank}:\n{rank_out[name]}"


def test_no_graph_walk_with_static_graph(results):
    for rank_out in results:
        assert rank_out["walks/static"] == 0
        assert rank_out["walks/dynamic"] == STEPS  # the dynamic path walks every step: the count is real


def test_a_changed_graph_is_an_error_naming_the_parameter(results):
    for rank_out in results:
        message = rank_out["changed_graph"]
        assert "static_graph=True, but parameter(s) 'never.weight' (0 of 1)" in message, message
        assert "Pass static_graph=False" in message
