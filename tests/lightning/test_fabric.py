"""The Fabric strategy (lightning_ddpx.lightning.strategies.fabric.DDPXStrategy): accumulation, exact resume, same options as the
Trainer strategy.

Every Fabric loop of this module runs in ONE 2-process gloo job (module fixture), to pay for process start-up
once; each test checks one property of its results. The processes find MASTER_ADDR/RANK/LOCAL_RANK/WORLD_SIZE
in their environment, so ``Fabric(accelerator="cpu", devices=2)`` launches nothing and its strategy creates
the process group; later Fabric objects in the same process reuse it.
"""

from __future__ import annotations

import os
import pickle
import warnings
from contextlib import nullcontext
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_ddpx
from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy, take_comm_stats
from tests.dist_utils import run_distributed
from tests.strategy_helpers import counting_allreduce_hook, quiet

ACCUMULATE = 3
WINDOWS = 2
# Caps small enough for two buckets (output layer 272 B, input layer 576 B), so "one collective per
# bucket per window" is not "one per window".
SMALL_BUCKETS = {"first_bucket_cap_mb": 300 / 2**20, "bucket_cap_mb": 600 / 2**20}
POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
STEPS, SAVE_AT = 8, 4


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different data on every rank: an unreduced gradient cannot pass for a reduced one."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)) for _ in range(count)
    ]


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def launch(**options) -> Fabric:
    strategy = DDPXStrategy(timeout=timedelta(seconds=60), **options)  # the first one creates the group
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


# ----------------------------------------------------------------------------------------- accumulation
def accumulate_with_fabric(rank: int, out: dict) -> None:
    counts = {"buckets": 0, "syncs": 0}
    fabric = launch(comm_hook=counting_allreduce_hook, comm_state=counts, **SMALL_BUCKETS)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for i, (x, y) in enumerate(batches(rank, ACCUMULATE * WINDOWS)):
        steps_now = (i + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not steps_now):
            fabric.backward(nn.functional.mse_loss(model(x), y) / ACCUMULATE)
        if steps_now:
            optimizer.step()
            optimizer.zero_grad()
    out["accumulate/counts"] = counts
    out["accumulate/stats"] = take_comm_stats(model)
    out["accumulate/buckets"] = len(model._forward_module.bucket_plan())
    out["accumulate/fabric"] = parameters_of(model.module)


def accumulate_with_torch_ddp(rank: int, out: dict) -> None:
    """The reference: torch's DDP driven by hand, ``no_sync()`` on the micro-batches that do not step."""
    ddp = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(batches(rank, ACCUMULATE * WINDOWS)):
        steps_now = (i + 1) % ACCUMULATE == 0
        with ddp.no_sync() if not steps_now else nullcontext():
            (nn.functional.mse_loss(ddp(x), y) / ACCUMULATE).backward()
        if steps_now:
            optimizer.step()
            optimizer.zero_grad()
    out["accumulate/torch"] = parameters_of(ddp.module)


# --------------------------------------------------------------------------------------------- resume
def train_powersgd(fabric: Fabric, model, optimizer, data) -> None:
    for x, y in data:
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def setup_powersgd(seed: int):
    fabric = launch(comm_hook="powersgd", powersgd=POWERSGD)
    model = make_model(seed)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return fabric, model, optimizer


def resume_from(path: str, data, out: dict, label: str) -> None:
    """A new Fabric, model (other seed: load must restore the weights) and optimizer; load; continue."""
    fabric, model, optimizer = setup_powersgd(seed=1)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, state)
    out[f"{label}/warnings"] = [str(w.message) for w in caught if "lightning_ddpx" in str(w.message)]
    out[f"{label}/step"] = state["step"]
    train_powersgd(fabric, model, optimizer, data[state["step"] :])
    out[label] = parameters_of(model.module)
    out[f"{label}/iteration"] = model._forward_module.comm_hook_state.iter


def powersgd_resume(rank: int, directory: str, out: dict) -> None:
    data = batches(rank, STEPS)
    fabric, model, optimizer = setup_powersgd(seed=0)
    train_powersgd(fabric, model, optimizer, data)
    out["continuous"] = parameters_of(model.module)
    out["continuous/iteration"] = model._forward_module.comm_hook_state.iter

    fabric, model, optimizer = setup_powersgd(seed=0)
    train_powersgd(fabric, model, optimizer, data[:SAVE_AT])
    path = os.path.join(directory, "powersgd.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": SAVE_AT})
    out["path"] = path
    resume_from(path, data, out, "resumed")

    # The same checkpoint without the hook entry (as another strategy would write it): the model and the
    # optimizer resume, the hook state starts fresh with a warning -- and the run is no longer exact.
    stripped = os.path.join(directory, "stripped.ckpt")
    if rank == 0:
        checkpoint = torch.load(path, weights_only=True)
        del checkpoint["lightning_ddpx"]
        torch.save(checkpoint, stripped)
    dist.barrier()
    resume_from(stripped, data, out, "stripped")


def fabric_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    out: dict = {}
    accumulate_with_fabric(rank, out)
    accumulate_with_torch_ddp(rank, out)
    powersgd_resume(rank, directory, out)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("fabric"))
    return run_distributed(fabric_job, 2, directory, init_process_group=False, timeout=240, pg_timeout=60)


@pytest.mark.slow
@pytest.mark.processes
def test_accumulation_synchronises_once_per_bucket_per_window(results):
    for rank_result in results:
        assert rank_result["accumulate/buckets"] == 2
        # the first synchronisation reduces torch's construction-time layout, one bucket; then two
        assert rank_result["accumulate/counts"] == {"syncs": WINDOWS, "buckets": 1 + (WINDOWS - 1) * 2}
        stats = rank_result["accumulate/stats"]  # take_comm_stats: synchronised steps only
        assert stats.steps == WINDOWS and stats.buckets == (1 + (WINDOWS - 1) * 2) / WINDOWS  # mean per step
        assert stats.bytes_to_hook > 0
        assert stats.bytes_sent is None  # the counting test hook does not report what it sends


@pytest.mark.slow
@pytest.mark.processes
def test_accumulation_matches_torch_ddp_driven_by_hand(results):
    for rank_result in results:
        for name, expected in rank_result["accumulate/torch"].items():
            torch.testing.assert_close(rank_result["accumulate/fabric"][name], expected, rtol=1e-6, atol=1e-7)
    for name, value in results[0]["accumulate/fabric"].items():
        assert torch.equal(value, results[1]["accumulate/fabric"][name]), f"ranks disagree on {name}"


@pytest.mark.slow
@pytest.mark.processes
def test_powersgd_resume_is_bit_identical_to_uninterrupted_training(results):
    for rank_result in results:
        assert rank_result["resumed/warnings"] == []
        assert rank_result["resumed/step"] == SAVE_AT
        assert rank_result["resumed/iteration"] == rank_result["continuous/iteration"] == STEPS
        for name, expected in rank_result["continuous"].items():
            assert torch.equal(rank_result["resumed"][name], expected), name


@pytest.mark.slow
@pytest.mark.processes
def test_resume_without_hook_state_warns_and_is_not_exact(results):
    (message,) = results[0]["stripped/warnings"]  # rank_zero_warn: once, on rank 0
    assert "holds no communication-hook state" in message
    assert results[1]["stripped/warnings"] == []
    continuous, stripped = results[0]["continuous"], results[0]["stripped"]
    assert any(not torch.equal(stripped[name], value) for name, value in continuous.items()), (
        "fresh PowerSGD state gave the same parameters: the exact-resume test could not fail"
    )


@pytest.mark.slow
@pytest.mark.processes
def test_checkpoint_loads_with_weights_only_and_holds_every_rank(results):
    checkpoint = torch.load(results[0]["path"], weights_only=True)
    assert set(checkpoint["model"]) == set(make_model().state_dict()), "saved without our wrapper's prefix"
    assert checkpoint["step"] == SAVE_AT
    entry = checkpoint["lightning_ddpx"]["model"]  # keyed like the model in fabric.save's state
    assert entry["format"] == 1 and entry["hook"] == "powersgd" and entry["world_size"] == 2
    assert entry["shared"]["iteration"] == SAVE_AT
    assert entry["bucket_layout"]
    errors = [part["error"] for part in entry["per_rank"]]
    assert len(errors) == 2 and errors[0] and errors[0].keys() == errors[1].keys()
    bucket = next(iter(errors[0]))
    assert not torch.equal(errors[0][bucket], errors[1][bucket]), "ranks' residuals differ: both are kept"


# ------------------------------------------------------------------------------ options and names
BAD_OPTIONS = [
    ({"comm_hook": "powersdg"}, ValueError),
    ({"comm_hook": 3}, TypeError),
    ({"comm_wrapper": "fp16"}, ValueError),
    ({"comm_hook": "powersgd", "comm_state": object()}, ValueError),
    ({"comm_hook": "fp16", "powersgd": {}}, ValueError),
    ({"comm_hook": "powersgd", "powersgd": {"rank": 2}}, ValueError),
    ({"bucket_cap_mb": 0}, ValueError),
]


@pytest.mark.parametrize("options, error", BAD_OPTIONS)
def test_bad_options_fail_as_in_the_trainer_strategy(options, error):
    with pytest.raises(error) as trainer_error:
        lightning_ddpx.DDPXStrategy(**options)
    with pytest.raises(error) as fabric_error:
        DDPXStrategy(**options)
    assert str(fabric_error.value) == str(trainer_error.value)


def test_unknown_hook_name_lists_the_registered_ones():
    names = ", ".join(lightning_ddpx.hooks.available_hooks())
    with pytest.raises(ValueError, match=f"unknown comm_hook 'powersdg'. Registered names: {names};"):
        DDPXStrategy(comm_hook="powersdg")


@pytest.mark.parametrize("name", sorted(n for n in STRATEGY_REGISTRY if n.startswith("ddpx")))
def test_fabric_names_build_the_fabric_strategy_with_the_trainer_options(name):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=name)
    trainer_strategy = StrategyRegistry.get(name)
    assert type(fabric.strategy) is DDPXStrategy
    assert fabric.strategy.ddpx_config == trainer_strategy.ddpx_config
    assert fabric.strategy._start_method == trainer_strategy._start_method


def test_options_are_read_only_and_survive_pickling_for_spawn():
    strategy = DDPXStrategy(comm_hook="powersgd", powersgd={"start_powerSGD_iter": 10})
    assert strategy.hook_name == "powersgd" and strategy.powersgd.start_powerSGD_iter == 10
    with pytest.raises(AttributeError, match="comm_hook is read-only"):
        strategy.comm_hook = "fp16"
    assert pickle.loads(pickle.dumps(strategy)).ddpx_config == strategy.ddpx_config


def test_no_backward_sync_control_is_lightnings_kind_and_takes_torchs_module_too():
    """Oracle: Fabric's own DDP strategy. Ours is a subclass of its sync control, refuses an unwrapped
    module with the same phrase, and calls ``no_sync()`` of our module or of torch's, only when enabled."""
    from unittest.mock import MagicMock

    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    theirs, ours = FabricDDPStrategy()._backward_sync_control, DDPXStrategy()._backward_sync_control
    assert isinstance(ours, _DDPBackwardSyncControl)
    phrase = "is only possible if the module passed to .* is wrapped in `DistributedDataParallel`"
    for control in (theirs, ours):
        with pytest.raises(TypeError, match=phrase):
            control.no_backward_sync(nn.Linear(1, 1), True)
    for wrapper in (TorchDDP, lightning_ddpx.DistributedDataParallel):
        module = MagicMock(spec=wrapper)
        with ours.no_backward_sync(module, False):
            module.no_sync.assert_not_called()
        with ours.no_backward_sync(module, True):
            module.no_sync.assert_called_once()
