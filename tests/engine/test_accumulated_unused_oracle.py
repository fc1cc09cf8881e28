"""A parameter that receives gradients only in ``no_sync()`` micro-batches, against torch's DDP.

torch's reducer keeps the bitmap of parameters used on this rank across ``no_sync()`` backwards and shares it
at the next synchronised backward: a parameter used in any accumulated micro-batch on any rank is averaged
(a rank holding no gradient contributes zeros and receives the average). Here our module and torch's train
side by side with rank-dependent data; after every step the gradients (``None`` or not, and their values) and
the parameters must equal torch's within 1e-6, on every rank. Each scenario also checks that the parameter
in question did receive an averaged gradient on a rank that never used it, so a run where it is never
exercised cannot pass.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from tests.dist_utils import run_distributed
from tests.oracle import assert_same_tensors, rank_batch, set_shared_memory

pytestmark = [pytest.mark.slow, pytest.mark.processes]

SMALL_BUCKETS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0002}  # several buckets
STEPS = 5
TOLERANCE = 1e-6

Plan = Callable[[int, int, int], set]  # (rank, step, micro-batch) -> optional branches used


class Optional2(nn.Module):
    """A trunk and a head used always; ``side`` and ``other`` only when the plan says so."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.side = nn.Linear(16, 4)
        self.other = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use: set) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        y = self.head(h)
        if "side" in use:
            y = y + self.side(h)
        if "other" in use:
            y = y + self.other(h)
        return y


def only_rank0_in_no_sync(rank: int, step: int, k: int) -> set:
    return {"side"} if rank == 0 and k == 0 else set()


def both_ranks_in_no_sync(rank: int, step: int, k: int) -> set:
    return {"side"} if k == 0 else set()


def different_micro_batches(rank: int, step: int, k: int) -> set:
    """With 3 micro-batches: rank 0 uses ``side`` in the first and ``other`` in the last (synchronised)
    one, rank 1 the reverse, and the middle one uses neither."""
    if k == 1:
        return set()
    first = k == 0
    return {"side"} if (rank == 0) == first else {"other"}


def rank0_on_even_steps(rank: int, step: int, k: int) -> set:
    """Odd steps: no rank uses ``side``, whose gradient must stay ``None`` everywhere."""
    return {"side"} if rank == 0 and k == 0 and step % 2 == 0 else set()


def rank1_always_rank0_in_no_sync(rank: int, step: int, k: int) -> set:
    """Static graph: rank 1 uses ``side`` in every micro-batch, rank 0 only in its no_sync() one."""
    return {"side"} if rank == 1 or k == 0 else set()


SCENARIOS: dict[str, dict[str, Any]] = {
    "one_rank": {"plan": only_rank0_in_no_sync},
    "one_rank_gloo": {"plan": only_rank0_in_no_sync, "shared_memory": False},
    "one_rank_as_view": {"plan": only_rank0_in_no_sync, "kwargs": {"gradient_as_bucket_view": True}},
    "one_rank_allreduce_hook": {"plan": only_rank0_in_no_sync, "hook": True},
    "one_rank_kept_grads": {"plan": only_rank0_in_no_sync, "set_to_none": False},
    "both_ranks": {"plan": both_ranks_in_no_sync, "all_use": True},
    # every rank uses both branches, each in another micro-batch: nothing to receive unused
    "different_micro_batches": {"plan": different_micro_batches, "accumulate": 3, "all_use": True},
    "different_micro_batches_as_view": {
        "plan": different_micro_batches,
        "accumulate": 3,
        "kwargs": {"gradient_as_bucket_view": True},
        "all_use": True,
    },
    "even_steps_only": {"plan": rank0_on_even_steps},
    "even_steps_only_as_view": {"plan": rank0_on_even_steps, "kwargs": {"gradient_as_bucket_view": True}},
    # torch's static_graph fails when no_sync() comes first (pytorch issue 143580): its find_unused path is
    # the oracle, the maths being the same
    "static_graph": {
        "plan": rank1_always_rank0_in_no_sync,
        "kwargs": {"static_graph": True, "find_unused_parameters": False},
        "torch_kwargs": {"find_unused_parameters": True},
        "all_use": True,
    },
    "overlap_optimizer": {"plan": only_rank0_in_no_sync, "overlap": True},
    "overlap_optimizer_even_steps": {"plan": rank0_on_even_steps, "overlap": True},
}


def _loss(model: nn.Module, plan: Plan, step: int, k: int) -> torch.Tensor:
    rank = dist.get_rank()
    x = rank_batch(rank, 10 * step + k, (8, 16))
    return model(x, plan(rank, step, k)).pow(2).mean() * (rank + 1)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()}


def side_by_side(rank: int, scenario: dict[str, Any]) -> dict[str, Any]:
    """Train ours and torch's; compare after every step (raises on the first difference)."""
    set_shared_memory(scenario.get("shared_memory", True))
    kwargs = {"find_unused_parameters": True, **SMALL_BUCKETS, **scenario.get("kwargs", {})}
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in ("first_bucket_cap_mb", "static_graph")}
    torch_kwargs.update(scenario.get("torch_kwargs", {}))
    torch.manual_seed(0)
    base = Optional2()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **torch_kwargs)
    if scenario.get("hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ours.register_comm_hook(None, lightning_ddpx.hooks.allreduce_hook)
        theirs.register_comm_hook(None, default_hooks.allreduce_hook)
    plan, accumulate = scenario["plan"], scenario.get("accumulate", 2)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    overlap = scenario.get("overlap", False)
    if overlap:
        ours.overlap_optimizer_with(optimizers[0])
    set_to_none = scenario.get("set_to_none", True)
    averaged_unused_here = 0  # steps where this rank never used `side` yet received an averaged gradient
    for step in range(STEPS):
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad(set_to_none=set_to_none)
            for k in range(accumulate):
                if k < accumulate - 1:
                    with model.no_sync():
                        _loss(model, plan, step, k).backward()
                else:
                    _loss(model, plan, step, k).backward()
            if not (overlap and model is ours):
                optimizer.step()
        assert_same_tensors(
            _grads(ours), _grads(theirs), f"rank {rank} step {step} grad", TOLERANCE, TOLERANCE
        )
        params = [dict(m.module.named_parameters()) for m in (ours, theirs)]
        assert_same_tensors(params[0], params[1], f"rank {rank} step {step} param", TOLERANCE, TOLERANCE)
        used_here = any("side" in plan(rank, step, k) for k in range(accumulate))
        grad = ours.module.side.weight.grad
        if not used_here and grad is not None and grad.abs().sum() > 0:
            averaged_unused_here += 1
    ours.close()
    return {"averaged_unused_here": averaged_unused_here}


def run_scenarios(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    return {name: side_by_side(rank, SCENARIOS[name]) for name in names}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    return run_distributed(run_scenarios, 2, sorted(SCENARIOS), timeout=300)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_gradients_used_only_in_no_sync_are_averaged_like_torch(
    outcomes: list[dict[str, Any]], name: str
) -> None:
    """Equality with torch is checked inside the job; here: the scenario did exercise a rank that never
    used ``side`` receiving the average of the others' gradients (unless every rank uses it)."""
    exercised = [outcome[name]["averaged_unused_here"] for outcome in outcomes]
    if SCENARIOS[name].get("all_use"):
        assert exercised == [0, 0]
    else:
        assert max(exercised) > 0, f"{name}: no rank received an averaged gradient it did not produce"


def run_three_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return side_by_side(rank, SCENARIOS["one_rank"])


def test_three_ranks_like_torch() -> None:
    outcomes = run_distributed(run_three_ranks, 3, timeout=180)
    assert [o["averaged_unused_here"] > 0 for o in outcomes] == [False, True, True]


def static_graph_violation(rank: int, world_size: int) -> str:
    """static_graph records ``side`` as unused everywhere; then every rank uses it in a no_sync() backward."""
    torch.manual_seed(0)
    model = lightning_ddpx.DistributedDataParallel(Optional2(), static_graph=True)
    x = rank_batch(rank, 0, (8, 16))
    model(x, set()).sum().backward()
    model(x, set()).sum().backward()
    with model.no_sync():
        try:
            model(x, {"side"}).sum().backward()
        except RuntimeError as error:
            return str(error)
    return "no error"


def test_static_graph_refuses_a_gradient_it_could_never_average() -> None:
    """torch's static_graph leaves such a gradient unreduced, so ranks silently differ; we raise instead."""
    for rank, message in enumerate(run_distributed(static_graph_violation, 2, timeout=120)):
        assert f"(rank {rank}): static_graph=True, but parameter 'side." in message
        assert "received a gradient in a no_sync() backward" in message
        assert "find_unused_parameters=True" in message
