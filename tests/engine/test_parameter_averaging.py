"""Parameter averaging on its own seam: post-local SGD and DiLoCo on the bare module, and the guard.

The hook list offers ``"diloco"`` and ``"post_local_sgd"`` for the bare module too. Both keep each rank's
gradients local (DiLoCo always, post-local SGD after ``start_localSGD_iter``), so the ranks' parameters are
brought together after optimizer steps by the algorithm the hook state brings. On 2 ranks, with
rank-dependent batches:

- the documented loop -- ``model.register_comm_hook(*build_comm_hook(name, ...))``, then
  ``model.average_parameters_after_step()`` after every ``optimizer.step()`` -- leaves bitwise-equal
  replicas exactly at the steps where the algorithm synchronises them (and different ones in between, so
  the check is not vacuous), with bit for bit the numbers of the older recipes (``state.averager.
  average_parameters(...)``, the strategies' set-up);
- the same loop without the call raises at the next synchronising forward on every rank, naming the
  algorithm, the call and the docs. Before, each rank trained alone and nothing was raised;
- the strategies (Trainer in automatic and manual optimisation, Fabric) call the same method and never
  trip the guard.

In one process: which optimizer steps count, which forwards check, the hook's lifetime (none at all
without parameter averaging), and an algorithm of one's own on the seam.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any, Callable, ContextManager, Mapping, Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks  # the guard's hook, looked for by the tests

import lightning_ddpx
from lightning_ddpx.hooks import build_comm_hook
from tests.dist_utils import one_rank_group, run_distributed
from tests.oracle import rank_batch
from tests.strategy_helpers import ManualTwoOptimizers, TinyRegressor, fit, quiet

STEPS = 12
HOOKS: dict[str, dict[str, Any]] = {
    # outer steps after inner steps 5 and 10
    "diloco": {"diloco": {"period": 5}},
    # global gradient averaging for 3 backwards, then none (subgroup=1); the model averaged after steps 4, 8, 12
    "post_local_sgd": {"post_local_sgd": {"start_localSGD_iter": 3, "period": 4, "subgroup": 1}},
}
# 1-based optimizer steps after which the replicas must be bitwise equal (and only those)
EQUAL_AFTER = {"diloco": {5, 10}, "post_local_sgd": {1, 2, 3, 4, 8, 12}}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    return model(rank_batch(rank, step, (6, 8))).square().mean()


def equal_on_every_rank(model: nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def documented_loop(rank: int, name: str, call: bool = True) -> dict[str, Any]:
    """What docs/diloco.md and docs/hooks.md show for the bare module."""
    model = lightning_ddpx.DistributedDataParallel(net())
    model.register_comm_hook(*build_comm_hook(name, **HOOKS[name]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    equal_after, changed = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.step()
        if call:
            changed.append(model.average_parameters_after_step())
        if equal_on_every_rank(model.module):
            equal_after.append(step + 1)
    params = [p.detach().clone() for p in model.parameters()]
    model.close()
    return {"params": params, "equal_after": equal_after, "changed": changed}


def older_recipe(rank: int, name: str) -> list[torch.Tensor]:
    """The loops the existing tests drive: DiLoCo as tests/hooks/test_diloco_oracle.py (the strategies' set-up,
    ``state.averager.average_parameters(optimizer.param_groups)``), post-local SGD as
    tests/hooks/test_post_local_sgd_oracle.py (torch's spelling, ``state.averager.average_parameters(...)``)."""
    if name == "diloco":
        from lightning_ddpx.lightning.settings.config import DDPXConfig

        config = DDPXConfig(comm_hook="diloco", diloco=HOOKS[name]["diloco"])
        model = config.wrap(net())
        state = config.register_hook(model)
    else:
        from lightning_ddpx.hooks import PostLocalSGDState, post_local_sgd_hook

        options = HOOKS[name]["post_local_sgd"]
        model = lightning_ddpx.DistributedDataParallel(net())
        state = PostLocalSGDState(None, 1, options["start_localSGD_iter"], period=options["period"])
        model.register_comm_hook(state, post_local_sgd_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.step()
        if name == "diloco":
            state.averager.average_parameters(optimizer.param_groups)
        else:
            state.averager.average_parameters(model.parameters())
    params = [p.detach().clone() for p in model.parameters()]
    model.close()
    return params


def without_the_call(rank: int, name: str) -> dict[str, Any]:
    """The documented loop minus the call: where (if anywhere) it raises, and what it says."""
    model = lightning_ddpx.DistributedDataParallel(net())
    model.register_comm_hook(*build_comm_hook(name, **HOOKS[name]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        for step in range(STEPS):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
            optimizer.step()
    except RuntimeError as error:
        return {"raised_at": step, "message": str(error)}
    finally:
        model.close()
    return {"raised_at": None, "message": "", "equal": equal_on_every_rank(model.module)}


def bare_module_job(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in HOOKS:
        out[name] = documented_loop(rank, name)
        out[name]["older"] = older_recipe(rank, name)
        out[name]["without"] = without_the_call(rank, name)
    return out


@pytest.fixture(scope="module")
def bare_module_outcomes() -> list[dict[str, Any]]:
    return run_distributed(bare_module_job, 2, timeout=180)


@pytest.mark.parametrize("name", list(HOOKS))
@pytest.mark.processes
def test_the_documented_call_synchronises_the_replicas_where_the_algorithm_does(bare_module_outcomes, name):
    for out in bare_module_outcomes:
        run = out[name]
        assert set(run["equal_after"]) == EQUAL_AFTER[name], run["equal_after"]
        if name == "diloco":  # the call says when it changed the parameters: at the outer steps
            assert [i + 1 for i, changed in enumerate(run["changed"]) if changed] == [5, 10]
        else:  # an average is due at steps 4, 8, 12 (the warm-up's steps average nothing)
            assert [i + 1 for i, changed in enumerate(run["changed"]) if changed] == [4, 8, 12]
    # the replicas end equal (step 12 is an average for post-local SGD) or differ (DiLoCo, between syncs)
    first, second = (out[name]["params"] for out in bare_module_outcomes)
    assert all(torch.equal(a, b) for a, b in zip(first, second)) == (STEPS in EQUAL_AFTER[name])


@pytest.mark.parametrize("name", list(HOOKS))
@pytest.mark.processes
def test_the_documented_call_gives_the_older_recipes_numbers_bit_for_bit(bare_module_outcomes, name):
    for out in bare_module_outcomes:
        ours, older = out[name]["params"], out[name]["older"]
        assert len(ours) == len(older)
        for a, b in zip(ours, older):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(HOOKS))
@pytest.mark.processes
def test_without_the_call_every_rank_raises_at_the_next_synchronising_forward(bare_module_outcomes, name):
    algorithm = {"diloco": "DiLoCo's outer step", "post_local_sgd": "post-local SGD's model averaging"}[name]
    docs = {"diloco": "docs/diloco.md", "post_local_sgd": "docs/hooks.md"}[name]
    for rank, out in enumerate(bare_module_outcomes):
        without = out[name]["without"]
        assert without["raised_at"] == 1, without  # the forward after the first optimizer step
        message = without["message"]
        for needed in (
            f"rank {rank}",
            algorithm,
            "model.average_parameters_after_step()",
            "optimizer.step()",
            docs,
        ):
            assert needed in message, (needed, message)


# ------------------------------------------------------------------------------------ the strategies
def trainer_job(rank: int, world_size: int) -> dict[str, Any]:
    """Trainer fits that would raise if the strategy left the call out: DiLoCo in automatic optimisation,
    post-local SGD in manual optimisation with two optimizers (the module's check at ``prepare_for_backward``)."""
    quiet()
    from lightning_ddpx import DDPXStrategy

    out: dict[str, Any] = {}
    strategy = DDPXStrategy(comm_hook="diloco", diloco={"period": 3}, timeout=timedelta(seconds=60))
    fit(strategy, max_steps=8, model_cls=TinyRegressor)
    out["diloco"] = (strategy.comm_hook_state.step, strategy.comm_hook_state.syncs)
    strategy = DDPXStrategy(
        comm_hook="post_local_sgd",
        post_local_sgd={"start_localSGD_iter": 2, "period": 2, "subgroup": 1},
        timeout=timedelta(seconds=60),
    )
    fit(strategy, max_steps=8, model_cls=ManualTwoOptimizers)  # 8 optimizer steps: 4 batches
    state = strategy.comm_hook_state
    out["post_local_sgd"] = (state.iter, state.averager.step)
    return out


def fabric_job(rank: int, world_size: int) -> dict[str, Any]:
    quiet()
    from lightning.fabric import Fabric

    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy

    strategy = DDPXStrategy(comm_hook="diloco", diloco={"period": 3}, timeout=timedelta(seconds=60))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(7):
        fabric.backward(loss_of(model, rank, step))
        optimizer.step()
        optimizer.zero_grad()
    state = model._forward_module.comm_hook_state
    return {"diloco": (state.step, state.syncs)}


@pytest.mark.slow
@pytest.mark.processes
def test_the_trainer_strategy_runs_the_averaging_and_never_trips_the_guard():
    for out in run_distributed(trainer_job, 2, timeout=240, init_process_group=False):
        assert out["diloco"] == (8, 2)  # outer steps after inner steps 3 and 6
        assert out["post_local_sgd"] == (2, 8)


@pytest.mark.slow
@pytest.mark.processes
def test_the_fabric_strategy_runs_the_averaging_and_never_trips_the_guard():
    for out in run_distributed(fabric_job, 2, timeout=180, init_process_group=False):
        assert out["diloco"] == (7, 2)


# ------------------------------------------------------------------------------------ in one process
def hook_count() -> int:
    return len(_global_optimizer_post_hooks)


def test_a_module_without_parameter_averaging_installs_no_hook_and_the_call_does_nothing() -> None:
    before = hook_count()
    with one_rank_group():
        for name, options in (
            ("allreduce", {}),
            ("powersgd", {}),
            ("post_local_sgd", {"post_local_sgd": {}}),
        ):
            model = lightning_ddpx.DistributedDataParallel(net())
            model.register_comm_hook(*build_comm_hook(name, **options))  # post_local_sgd without a period
            assert model.parameter_averaging is None and hook_count() == before, name
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2):
                loss_of(model, 0, step).backward()
                optimizer.step()
            assert model.average_parameters_after_step() is False
            model.close()


def test_the_hook_goes_with_the_module() -> None:
    before = hook_count()
    with one_rank_group():
        model = lightning_ddpx.DistributedDataParallel(net())
        model.register_comm_hook(*build_comm_hook("diloco", **HOOKS["diloco"]))
        assert hook_count() == before + 1
        model.close()
        assert hook_count() == before
        model = lightning_ddpx.DistributedDataParallel(net())
        model.register_comm_hook(*build_comm_hook("diloco", **HOOKS["diloco"]))
        assert hook_count() == before + 1
        del model
        gc.collect()
        assert hook_count() == before  # the hook does not keep the module alive


def test_only_steps_of_optimizers_holding_the_module_count_and_only_synchronising_forwards_check() -> None:
    with one_rank_group():
        model = lightning_ddpx.DistributedDataParallel(net())
        model.register_comm_hook(*build_comm_hook("diloco", **HOOKS["diloco"]))
        other = nn.Linear(8, 4)
        unrelated = torch.optim.SGD(other.parameters(), lr=0.1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):  # another model's optimizer: not this module's step
            other(rank_batch(0, step, (2, 8))).sum().backward()
            unrelated.step()
            loss_of(model, 0, step).backward()
            optimizer.step()
            model.average_parameters_after_step()  # (its outer optimizer steps too: not the module's step)
        loss_of(model, 0, 3).backward()
        optimizer.step()
        with torch.no_grad():
            model(rank_batch(0, 4, (2, 8)))  # evaluation does not synchronise: no check
        with model.no_sync():
            model(rank_batch(0, 4, (2, 8)))  # nor does a forward inside no_sync
        with pytest.raises(RuntimeError, match=r"model\.average_parameters_after_step\(\) after every"):
            model(rank_batch(0, 4, (2, 8)))
        with pytest.raises(RuntimeError, match="DiLoCo's outer step"):  # and again, until it runs
            model.prepare_for_backward(loss_of(model.module, 0, 4))
        model.average_parameters_after_step()
        loss_of(model, 0, 5).backward()  # runs again
        model.close()


class EveryOtherStep:
    """An algorithm of one's own: averages (here: halves, on one rank) every second step."""

    name = "halving every other step"
    docs = "the test"

    def __init__(self) -> None:
        self.step = 0
        self.asked: list[list[torch.Tensor]] = []

    def bind(self, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.bound = [name for name, _ in named_parameters]

    def after_optimizer_step(self, updated: Callable[[], Sequence[torch.Tensor]]) -> bool:
        self.step += 1
        if self.step % 2:
            return False
        self.asked.append(list(updated()))
        return True

    def global_parameters(self) -> ContextManager[None]:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.step = state_dict["step"]


def test_an_algorithm_of_ones_own_rides_the_seam_with_the_default_hook() -> None:
    with one_rank_group():
        base = net()
        base[0].weight.requires_grad_(False)
        model = lightning_ddpx.DistributedDataParallel(base)
        algorithm = EveryOtherStep()
        model.register_parameter_averaging(algorithm)
        assert model.parameter_averaging is algorithm
        assert algorithm.bound == [name for name, _ in base.named_parameters()]
        with pytest.raises(RuntimeError, match="already runs halving every other step"):
            model.register_parameter_averaging(EveryOtherStep())
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        assert [model.average_parameters_after_step() for _ in range(2)] == [False, True]
        trainable = [p for p in base.parameters() if p.requires_grad]  # the default: requires_grad
        assert len(algorithm.asked[0]) == len(trainable) and all(
            a is b for a, b in zip(algorithm.asked[0], trainable)
        )
        head = torch.optim.SGD(base[2].parameters(), lr=0.1)
        model.average_parameters_after_step([head])  # given optimizers: the module's parameters they hold
        model.average_parameters_after_step([head, optimizer])
        assert [len(asked) for asked in algorithm.asked] == [3, 3]  # step 4: head's two, then the first bias
        model.close()
