"""Post-local SGD on our module against torch's: ``post_localSGD_hook`` + ``PostLocalSGDState`` +
``PeriodicModelAverager`` (and ``HierarchicalModelAverager``) on torch's DDP, same seeds, rank-dependent data.

Each run crosses ``start_localSGD_iter`` and several averaging periods; parameters are compared after every
step (1e-6), and the replicas are checked to really drift apart between averages (so a hook that kept
averaging globally, or an averager that never ran, fails). A resumed bare-module run is compared bit for bit
with an uninterrupted one.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_pls
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hier

import lightning_ddpx
from lightning_ddpx.hooks import PostLocalSGDState, post_local_sgd_hook
from tests.dist_utils import run_distributed
from tests.oracle import assert_same_tensors, rank_batch

pytestmark = [pytest.mark.slow, pytest.mark.processes]

STEPS, START, PERIOD = 12, 4, 3
SMALL_BUCKETS = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001}  # several buckets: is_last counts


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    x = rank_batch(dist.get_rank(), step, (8, 16))
    return model(x).pow(2).mean()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def spread(model: nn.Module) -> float:
    """Largest difference of any parameter between this rank and the mean over ranks (0: all equal)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mean = flat.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    gap = (flat - mean).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap)


def side_by_side(ours_state, torch_state, our_averager, torch_averager, steps: int = STEPS) -> list[float]:
    base = make_model()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **SMALL_BUCKETS)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.004)
    ours.register_comm_hook(ours_state, post_local_sgd_hook)
    theirs.register_comm_hook(torch_state, torch_pls.post_localSGD_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    spreads = []
    for step in range(steps):
        for model, optimizer, averager in zip((ours, theirs), optimizers, (our_averager, torch_averager)):
            optimizer.zero_grad()
            loss_of(model, step).backward()
            optimizer.step()
            averager.average_parameters(model.parameters())
        assert_same_tensors(
            params(ours.module), params(theirs.module), f"rank {dist.get_rank()} step {step}", 1e-6, 1e-6
        )
        assert ours_state.iter == torch_state.iter, (step, ours_state.iter, torch_state.iter)
        spreads.append(spread(ours.module))
    assert len(ours.bucket_plan()) > 1  # rebuilt after the first step (torch's one bucket before)
    return spreads


def periodic_job(rank: int, world_size: int) -> dict:
    if world_size == 2:
        ours_sub, torch_sub = 1, dist.new_subgroups(group_size=1)[0]  # each rank on its own: local SGD
    else:  # uneven subgroups {0, 1} and {2}, given as a process group to both
        torch_sub = dist.new_subgroups_by_enumeration([[0, 1], [2]])[0]
        ours_sub = torch_sub
    ours_state = PostLocalSGDState(None, ours_sub, START, period=PERIOD)
    torch_state = torch_pls.PostLocalSGDState(None, torch_sub, START)
    torch_averager = torch_averagers.PeriodicModelAverager(period=PERIOD, warmup_steps=START)
    spreads = side_by_side(ours_state, torch_state, ours_state.averager, torch_averager)
    out = {"periodic": spreads, "averager_step": ours_state.averager.step}

    # post_local_gradient_allreduce=False: no gradient communication at all after the warm-up.
    ours_state = PostLocalSGDState(None, ours_sub, START, post_local_gradient_allreduce=False, period=PERIOD)
    torch_state = torch_pls.PostLocalSGDState(None, torch_sub, START, post_local_gradient_allreduce=False)
    torch_averager = torch_averagers.PeriodicModelAverager(period=PERIOD, warmup_steps=START)
    out["no_local_allreduce"] = side_by_side(ours_state, torch_state, ours_state.averager, torch_averager)
    return out


def check_spreads(spreads: list[float], start: int, due) -> None:
    for step, gap in enumerate(spreads):
        if step < start or due(step):
            assert gap < 1e-6, (step, spreads)  # global gradients, or just averaged: replicas equal
        else:
            assert gap > 1e-5, (step, spreads)  # local steps: replicas drift apart


@pytest.mark.parametrize("world_size", [2, 3])
def test_post_local_sgd_matches_torch_hook_and_periodic_averager(world_size):
    results = run_distributed(periodic_job, world_size, timeout=180)
    for out in results:
        assert out["averager_step"] == STEPS
        for key in ("periodic", "no_local_allreduce"):
            check_spreads(out[key], START, lambda s: (s - START) % PERIOD == 0)


def hierarchical_job(rank: int, world_size: int) -> list[float]:
    hierarchy = {2: 2, 4: 4}
    ours_state = PostLocalSGDState(None, 1, START, hierarchy=hierarchy)
    torch_state = torch_pls.PostLocalSGDState(None, dist.new_subgroups(group_size=1)[0], START)
    torch_averager = torch_hier.HierarchicalModelAverager(hierarchy, warmup_steps=START)
    return side_by_side(ours_state, torch_state, ours_state.averager, torch_averager)


def test_hierarchical_averaging_matches_torch_on_four_ranks():
    results = run_distributed(hierarchical_job, 4, timeout=180)
    # steps 4, 8: all four equal; 6, 10: pairs equal but not all four; the rest: drifting
    check_spreads(results[0], START, lambda s: s % 4 == 0)


# ------------------------------------------------------------------------------------------- resume
def train(model, optimizer, state, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_of(model, step).backward()
        optimizer.step()
        state.averager.average_parameters(model.parameters())


def build(save: bytes | None = None):
    base = make_model()
    model = lightning_ddpx.DistributedDataParallel(base, **SMALL_BUCKETS)
    state = PostLocalSGDState(None, 1, START, period=PERIOD)
    model.register_comm_hook(state, post_local_sgd_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if save is not None:
        checkpoint = torch.load(io.BytesIO(save), weights_only=True)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        state.load_state_dict(checkpoint["hook"])
    return model, optimizer, state


def resume_job(rank: int, world_size: int) -> dict:
    model, optimizer, state = build()
    train(model, optimizer, state, range(STEPS))
    continuous = params(model.module)

    save_at = START + 1  # inside a period: the averager's phase must survive the resume
    model, optimizer, state = build()
    train(model, optimizer, state, range(save_at))
    buffer = io.BytesIO()
    torch.save(
        {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()},
        buffer,
    )
    model, optimizer, state = build(buffer.getvalue())
    restored = (state.iter, state.averager.step)
    train(model, optimizer, state, range(save_at, STEPS))
    return {"continuous": continuous, "resumed": params(model.module), "restored": restored}


def test_bare_module_resume_is_bit_identical():
    for out in run_distributed(resume_job, 2, timeout=120):
        assert out["restored"] == (START, START + 1)
        assert_same_tensors(out["resumed"], out["continuous"], "resumed vs continuous", 0.0, 0.0)


# ---------------------------------------------------------------------------------------- statistics
def stats_job(rank: int, world_size: int) -> list:
    model = lightning_ddpx.DistributedDataParallel(make_model(), **SMALL_BUCKETS)
    state = PostLocalSGDState(None, 1, START, period=PERIOD)
    model.register_comm_hook(state, post_local_sgd_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    windows = []
    for window in (range(START), range(START, START + 3)):
        train(model, optimizer, state, window)
        summary = model.take_comm_stats()
        windows.append((summary.bytes_to_hook, summary.bytes_sent))
    return windows


def test_statistics_report_no_gradient_bytes_after_the_warm_up_with_subgroup_1():
    (warm, local), _ = run_distributed(stats_job, 2, timeout=60)
    assert warm[1] == warm[0] > 0  # global allreduce of every bucket
    assert local == (warm[0], 0)  # the same buckets reach the hook; nothing is sent
