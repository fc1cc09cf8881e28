"""Post-local SGD pieces in one process: options and their errors, the strategies' checks, the averagers'
schedules against torch's (on a one-rank gloo group), and state dicts that load with ``weights_only=True``."""

from __future__ import annotations

import io
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_pls
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hier
from torch.distributed.algorithms.model_averaging import utils as torch_averaging_utils

from lightning_ddpx import DDPXStrategy
from lightning_ddpx.hooks import PostLocalSGDOptions, PostLocalSGDState, build_comm_hook, post_local_sgd_hook
from lightning_ddpx.hooks.model_averaging import (
    HierarchicalModelAverager,
    PeriodicModelAverager,
    hierarchy_groups,
)
from lightning_ddpx.lightning.checkpoints.local_replicas import replica_for_rank
from lightning_ddpx.lightning.features.post_local_sgd_setup import check_optimizers
from tests.dist_utils import one_rank_group, run_distributed


# ------------------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    ("values", "error", "says"),
    [
        ({"start_localSGD_iter": -1}, ValueError, "start_localSGD_iter must be >= 0"),
        ({"period": 0}, ValueError, "period must be >= 1"),
        ({"subgroup": 0}, ValueError, "subgroup must be >= 1"),
        ({"period": 2.5}, TypeError, "period must be an integer"),
        ({"post_local_gradient_allreduce": "yes"}, TypeError, "post_local_gradient_allreduce must be True"),
        ({"hierarchy": {4: 2, 2: 4}}, ValueError, "periods must increase"),
        ({"hierarchy": {2: 2}, "period": 2}, ValueError, "give one"),
        ({"hierarchy": 3}, TypeError, "hierarchy must be a mapping"),
        ({"start_localsgd_iter": 3}, ValueError, "unknown post_local_sgd option(s) ['start_localsgd_iter']"),
    ],
)
def test_bad_options_name_the_option(values, error, says):
    with pytest.raises(error, match=None) as raised:
        PostLocalSGDOptions.from_dict(values)
    assert says in str(raised.value)


def test_hierarchy_from_yaml_takes_string_keys_and_pairs():
    assert PostLocalSGDOptions(hierarchy={"2": 2, "8": 4}).hierarchy == {2: 2, 8: 4}
    assert PostLocalSGDOptions(hierarchy=[[2, 2], [8, 4]]).hierarchy == {2: 2, 8: 4}


def test_named_hook_options_reach_the_state_and_are_refused_elsewhere():
    state, hook = build_comm_hook("post_local_sgd", post_local_sgd={"start_localSGD_iter": 7, "period": 3})
    assert hook is post_local_sgd_hook
    assert (state.start_localSGD_iter, state.period, state.iter) == (7, 3, 0)
    with pytest.raises(ValueError, match="takes no post_local_sgd options"):
        build_comm_hook("allreduce", post_local_sgd={"period": 2})


# ----------------------------------------------------------------------------------- strategy checks
@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"comm_hook": "post_local_sgd"}, ValueError, "no model averaging period is given"),
        (
            {"comm_hook": "post_local_sgd", "post_local_sgd": {"period": 2}, "model_averaging_period": 4},
            ValueError,
            "model_averaging_period=4 conflicts with post_local_sgd period=2",
        ),
        (
            {"comm_hook": "powersgd", "post_local_sgd": {"period": 2}},
            ValueError,
            "Set comm_hook='post_local_sgd'",
        ),
        (
            {"comm_hook": "post_local_sgd", "powersgd": {"start_powerSGD_iter": 2}},
            ValueError,
            "takes no powersgd options (its own go in post_local_sgd=...)",
        ),
        (
            {"comm_hook": "post_local_sgd", "model_averaging_period": 0},
            ValueError,
            "model_averaging_period must",
        ),
        (
            {"comm_hook": "post_local_sgd", "post_local_sgd": {"perod": 2}},
            ValueError,
            "unknown post_local_sgd",
        ),
        (
            {
                "comm_hook": torch_pls.post_localSGD_hook,
                "comm_state": torch_pls.PostLocalSGDState(None, None, start_localSGD_iter=8),
            },
            ValueError,
            "Pass model_averaging_period=N",
        ),
    ],
)
def test_strategy_refuses_bad_post_local_sgd_settings_in_the_constructor(kwargs, error, says):
    for strategy_class in (
        DDPXStrategy,
        __import__("lightning_ddpx.lightning.strategies.fabric").fabric.DDPXStrategy,
    ):
        with pytest.raises(error) as raised:
            strategy_class(**kwargs)
        assert says in str(raised.value), str(raised.value)


def test_model_averaging_period_fills_the_period_and_warns_without_post_local_sgd():
    strategy = DDPXStrategy(comm_hook="post_local_sgd", model_averaging_period=4)
    assert strategy.post_local_sgd.period == 4 and strategy.model_averaging_period == 4
    with pytest.warns(UserWarning, match="model_averaging_period=4 has no effect without post-local SGD"):
        DDPXStrategy(model_averaging_period=4)


def test_distributed_optimizers_are_refused():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    with one_rank_group():
        model = nn.Linear(2, 2)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        with pytest.raises(ValueError, match="cannot work with a ZeroRedundancyOptimizer"):
            check_optimizers([zero])
        check_optimizers([torch.optim.SGD(model.parameters(), lr=0.1)])


# --------------------------------------------------------------------------------------- averagers
def averaged_steps(averager, steps: int) -> list[int]:
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    return [s for s in range(steps) if averager.average_parameters(model.parameters())]


def torch_averaged_steps(averager, steps: int, monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(
        torch_averaging_utils,
        "average_parameters_or_parameter_groups",
        lambda p, g: calls.append(averager.step),
    )
    for _ in range(steps):
        averager.average_parameters([])
    return calls


@pytest.mark.parametrize(("period", "warmup"), [(1, 0), (2, 0), (3, 4), (4, 5)])
def test_periodic_schedule_is_torchs(period, warmup, monkeypatch):
    with one_rank_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = averaged_steps(PeriodicModelAverager(period, warmup), 20)
        theirs = torch_averaged_steps(torch_averagers.PeriodicModelAverager(period, warmup), 20, monkeypatch)
    assert ours == theirs and ours


@pytest.mark.parametrize("warmup", [0, 3, 5])
def test_hierarchical_schedule_is_torchs(warmup, monkeypatch):
    hierarchy = {2: 1, 3: 1, 8: 1}
    with one_rank_group():
        ours = averaged_steps(HierarchicalModelAverager(hierarchy_groups(hierarchy), warmup), 30)
        theirs = torch_averaged_steps(
            torch_hier.HierarchicalModelAverager(hierarchy, warmup), 30, monkeypatch
        )
    assert ours == theirs and ours


def test_hierarchy_must_end_with_the_whole_group():
    with (
        one_rank_group(),
        pytest.raises(ValueError, match="the last group size must be the size of the whole"),
    ):
        PostLocalSGDState(None, 1, 2, hierarchy={2: 2})


def test_subgroup_must_divide_the_world():
    with one_rank_group(), pytest.raises(ValueError, match="subgroup=2 does not divide the world size 1"):
        PostLocalSGDState(None, 2, 2, period=2)


def test_parameters_without_gradient_are_not_averaged_and_bad_input_is_named():
    with one_rank_group():
        averager = PeriodicModelAverager(2)
        with pytest.raises(TypeError, match="takes parameters"):
            averager.average_parameters([3])


# -------------------------------------------------------------------------------------- state dicts
def test_state_dict_loads_with_weights_only_and_restores_a_state_built_later():
    with one_rank_group():
        state = PostLocalSGDState(None, 1, 4, period=3)
        state.iter, state.averager.step = 4, 9
        buffer = io.BytesIO()
        torch.save(state.state_dict(), buffer)
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        assert saved == {
            "shared": {"version": 1, "iter": 4, "averager_step": 9, "start_localSGD_iter": 4},
            "per_rank": {},
        }
        fresh = PostLocalSGDState(None, 1, 4)  # no period yet: the step waits for the averager
        fresh.load_state_dict(saved)
        fresh.set_period(3)
        assert (fresh.iter, fresh.averager.step) == (4, 9)
        with pytest.raises(ValueError, match="PostLocalSGDState.load_state_dict expects"):
            fresh.load_state_dict({"iter": 3})
        with pytest.raises(ValueError, match="averager_step must be an integer >= 0"):
            fresh.load_state_dict({"shared": {"version": 1, "iter": 3, "averager_step": -1}, "per_rank": {}})


def test_replicas_of_another_world_size_warn():
    assert replica_for_rank(None, 0, 2) is None
    assert replica_for_rank([{"a": 1}, {"b": 2}], 1, 2) == {"b": 2}
    with pytest.warns(UserWarning, match="replicas of 3 ranks, but this run has 2"):
        assert replica_for_rank([{}, {}, {}], 0, 2) is None
    with pytest.warns(UserWarning, match="this run does not average models"):
        assert replica_for_rank([None, {"b": 2}], 1, 2, averaging=False) is None


# ----------------------------------------------------------------------- subgroup=None on one machine
def default_subgroup_job(rank: int, world_size: int) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = PostLocalSGDState(None, None, 2, period=2)
    return {
        "world": state.subgroup_process_group is dist.group.WORLD,
        "warnings": [str(w.message) for w in caught if "post_local_sgd" in str(w.message)],
    }


@pytest.mark.slow
@pytest.mark.processes
def test_default_subgroup_on_one_machine_is_every_rank_and_warns():
    results = run_distributed(default_subgroup_job, 2, timeout=60)
    assert all(r["world"] for r in results)
    assert (
        len(results[0]["warnings"]) == 1
        and "subgroup=None means the ranks on each machine" in (results[0]["warnings"][0])
    )
    assert results[1]["warnings"] == []  # once, from rank 0


def test_hierarchy_replaces_the_period_in_the_strategy():
    strategy = DDPXStrategy(comm_hook="post_local_sgd", post_local_sgd={"hierarchy": {"2": 1, "4": 2}})
    assert strategy.post_local_sgd.hierarchy == {2: 1, 4: 2} and strategy.post_local_sgd.period is None
    with pytest.raises(ValueError, match="conflicts with post_local_sgd hierarchy"):
        DDPXStrategy(
            comm_hook="post_local_sgd", post_local_sgd={"hierarchy": {4: 2}}, model_averaging_period=4
        )


# ------------------------------------------------------------- a state built before the process group
def lazy_job(rank: int, world_size: int) -> tuple:
    import lightning_ddpx

    state = PostLocalSGDState(None, 1, 1, period=2)  # no process group yet: groups come at the first hook
    assert state.averager is None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world_size)  # fmt: skip
    try:
        model = lightning_ddpx.DistributedDataParallel(nn.Linear(4, 2))
        model.register_comm_hook(state, post_local_sgd_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.full((2, 4), float(rank + step))).sum().backward()
            optimizer.step()
            state.averager.average_parameters(model.parameters())
            optimizer.zero_grad()
        return state.iter, state.averager.step
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.processes
def test_state_built_before_the_process_group_creates_its_groups_at_the_first_hook():
    assert run_distributed(lazy_job, 2, init_process_group=False, timeout=60) == [(1, 3), (1, 3)]
