"""``join()`` on our module against torch's DDP ``join()``, on uneven inputs over 2 and 3 gloo ranks.

Each rank trains a different number of SGD steps (``COUNTS``) inside ``with model.join(...)``: rank-dependent
data, several buckets (small caps), the same seeds for both wrappers. After the context every rank holds
the last joiner's model; ours must equal torch's within 1e-6 (fp16: 1e-3), on every rank. Hooks with no
torch twin that joins on several gloo buckets (PowerSGD) must run to the end with identical replicas.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lightning_ddpx
from lightning_ddpx import hooks
from tests.dist_utils import run_distributed
from tests.oracle import Branches, default_path, rank_batch, set_shared_memory, wide_4mib_mlp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.processes]

SMALL_BUCKETS = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001}
COUNTS = {2: [6, 3], 3: [6, 4, 0]}  # steps per rank: rank 2 of 3 has no input at all


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def conv_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


class SideInNoSync(nn.Module):
    """Rank 0 uses ``side`` in its no_sync() micro-batches only (every other call, accumulating two): its
    accumulated gradient must be averaged at the next synchronised backward, also once a rank has joined."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.side = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.trunk(x)
        return self.side(h) + h if dist.get_rank() == 0 and self.calls % 2 == 1 else h


class OwnPerRank(nn.Module):
    """``own`` and the buffer ``count_own`` are on torch's ignore list: each rank trains and keeps its own,
    through join() and its final model sync, as with torch's DDP."""

    IGNORED = ("own.weight", "own.bias", "count_own")

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.own = nn.Linear(16, 16)
        self.register_buffer("count_own", torch.zeros(3))
        self.register_buffer("count_shared", torch.zeros(2))
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self, self.IGNORED
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count_own += (dist.get_rank() + 1) ** 2  # differs per rank whatever its step count
        self.count_shared += dist.get_rank() + 1
        return self.own(torch.tanh(self.shared(x)))


def _loss(model: nn.Module, step: int, conv: bool) -> torch.Tensor:
    rank = dist.get_rank()
    shape = (4, 3, 8, 8) if conv else (8, 16)
    return model(rank_batch(rank, step, shape)).pow(2).mean() * (rank + 1)


def _train(model: nn.Module, steps: int, conv: bool, accumulate: int, join_kwargs: dict[str, Any]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with model.join(**join_kwargs):
        for step in range(steps):
            optimizer.zero_grad()
            for k in range(accumulate - 1):
                with model.no_sync():
                    _loss(model, 100 * step + k, conv).backward()
            _loss(model, step, conv).backward()
            optimizer.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    state.update({f"buffer:{name}": b.clone() for name, b in model.module.named_buffers()})
    return state


SCENARIOS: dict[str, dict[str, Any]] = {
    "mlp": {},
    "mlp_current_world_size": {"join": {"divide_by_initial_world_size": False}},
    "mlp_no_sync": {"accumulate": 2},
    "conv_bn": {"build": conv_bn, "conv": True},
    "branches_unused": {
        "build": functools.partial(Branches, never=False),
        "kwargs": {"find_unused_parameters": True},
    },
    "side_only_in_no_sync": {
        "build": SideInNoSync,
        "kwargs": {"find_unused_parameters": True},
        "accumulate": 2,
    },
    "mlp_as_view": {"kwargs": {"gradient_as_bucket_view": True}},
    "ignored_stay_each_ranks": {"build": OwnPerRank, "own": ("own.weight", "own.bias", "buffer:count_own")},
    "allreduce_hook": {"hook": ("allreduce", default_hooks.allreduce_hook)},
    "fp16_hook": {"hook": ("fp16", default_hooks.fp16_compress_hook), "tolerance": 1e-3},
    # large buckets between two ranks: summed through shared memory, or (shared memory off) by gloo
    "big_shared_memory": {
        "build": wide_4mib_mlp,
        "kwargs": {"bucket_cap_mb": 25, "first_bucket_cap_mb": 1},
        "path": "shared_memory",
    },
    "big_gloo": {
        "build": wide_4mib_mlp,
        "kwargs": {"bucket_cap_mb": 25, "first_bucket_cap_mb": 1},
        "shared_memory": False,
        "path": "whole",
    },
}


def run_against_torch(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    steps = COUNTS[world_size][rank]
    results = {}
    for name in names:
        scenario = SCENARIOS[name]
        torch.manual_seed(0)
        base = scenario.get("build", mlp)()
        kwargs = {**SMALL_BUCKETS, **scenario.get("kwargs", {})}
        torch_kwargs = {k: v for k, v in kwargs.items() if k not in ("first_bucket_cap_mb",)}
        set_shared_memory(scenario.get("shared_memory", True))
        ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **kwargs)
        theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **torch_kwargs)
        if "hook" in scenario:
            our_name, torch_hook = scenario["hook"]
            state, hook = hooks.build_comm_hook(our_name)
            ours.register_comm_hook(state, hook)
            theirs.register_comm_hook(None, torch_hook)
        for model in (ours, theirs):
            _train(
                model,
                steps,
                scenario.get("conv", False),
                scenario.get("accumulate", 1),
                scenario.get("join", {}),
            )
        # two ranks take the scenario's path; three keep one all-reduce per bucket
        expected = scenario.get("path", "shared_memory") if world_size == 2 else "whole"
        if "hook" not in scenario:
            path = default_path(ours)
            assert path == expected, f"{name}: {path} on {world_size} ranks, expected {expected}"
        results[name] = {
            "ours": _params(ours),
            "torch": _params(theirs),
            "tolerance": scenario.get("tolerance", 1e-6),
            "own": scenario.get("own", ()),  # each rank's own: equal to torch's, not across ranks
        }
    return results


def _check_against_torch(results: list[dict[str, Any]]) -> None:
    for rank, per_rank in enumerate(results):
        for name, result in per_rank.items():
            tol = result["tolerance"]
            for key, ours in result["ours"].items():
                torch.testing.assert_close(
                    ours, result["torch"][key], rtol=tol, atol=tol,
                    msg=lambda m, name=name, key=key, rank=rank: f"{name}, rank {rank}, {key}: {m}",
                )  # fmt: skip
                if key not in result["own"]:
                    torch.testing.assert_close(ours, results[0][name]["ours"][key], rtol=0, atol=0)
                elif rank > 0:
                    assert not torch.equal(ours, results[0][name]["ours"][key]), f"{name}: {key} was synced"


def test_join_matches_torch_two_ranks() -> None:
    _check_against_torch(run_distributed(run_against_torch, 2, sorted(SCENARIOS), timeout=180))


def test_join_matches_torch_three_ranks_one_without_input() -> None:
    names = [
        "mlp",
        "ignored_stay_each_ranks",
        "mlp_current_world_size",
        "conv_bn",
        "branches_unused",
        "side_only_in_no_sync",
        "fp16_hook",
    ]
    _check_against_torch(run_distributed(run_against_torch, 3, names, timeout=180))


# ---------------------------------------------------------------------------------------- PowerSGD
def run_powersgd(rank: int, world_size: int, batched: bool, debug: bool = False) -> dict[str, torch.Tensor]:
    if debug:  # DDPX_DEBUG's per-bucket sequence check: joined ranks must take part in it too
        os.environ["DDPX_DEBUG"] = "1"
    torch.manual_seed(0)
    model = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    options = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
    state, hook = hooks.build_comm_hook("batched_powersgd" if batched else "powersgd", powersgd=options)
    model.register_comm_hook(state, hook)
    _train(model, COUNTS[world_size][rank], conv=False, accumulate=1, join_kwargs={})
    assert len(model.bucket_plan()) > 1  # rebuilt after the first step (torch's one bucket before)
    # one more even step after the join: the joined ranks' PowerSGD state is in step with the others'
    _train(model, 1, conv=False, accumulate=1, join_kwargs={"enable": False})
    return _params(model)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("batched", [False, True], ids=["powersgd", "batched_powersgd"])
def test_powersgd_joins_and_replicas_agree(world_size: int, batched: bool) -> None:
    results = run_distributed(run_powersgd, world_size, batched, timeout=120, pg_timeout=30)
    for rank in range(1, world_size):
        for key, value in results[rank].items():
            torch.testing.assert_close(value, results[0][key], rtol=0, atol=0, msg=f"rank {rank} {key}")


def test_join_under_ddpx_debug_sequence_check() -> None:
    results = run_distributed(run_powersgd, 3, False, True, timeout=120, pg_timeout=30)
    for rank in range(1, 3):
        for key, value in results[rank].items():
            torch.testing.assert_close(value, results[0][key], rtol=0, atol=0, msg=f"rank {rank} {key}")


# ------------------------------------------------------------------------------ early termination
def run_throw(rank: int, world_size: int, impl: str) -> str:
    """Train inside join(throw_on_early_termination=True); report the first sentence of the error."""
    torch.manual_seed(0)
    ours = impl == "ours"
    model = (
        lightning_ddpx.DistributedDataParallel(mlp())
        if ours
        else torch.nn.parallel.DistributedDataParallel(mlp())
    )
    try:
        _train(model, COUNTS[world_size][rank], False, 1, {"throw_on_early_termination": True})
    except RuntimeError as error:
        return f"raised: {str(error).split('.')[0]}"
    return "finished without an error"


@pytest.mark.parametrize("world_size", [2, 3])
def test_throw_on_early_termination_raises_on_every_rank_like_torch(world_size: int) -> None:
    ours = run_distributed(run_throw, world_size, "ours", timeout=60, pg_timeout=20)
    theirs = run_distributed(run_throw, world_size, "torch", timeout=60, pg_timeout=20)
    assert ours == theirs
    assert all(outcome.startswith("raised") for outcome in ours), ours
