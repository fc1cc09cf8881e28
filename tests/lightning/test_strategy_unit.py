"""Single-process checks of DDPXStrategy's arguments and registry, and of the checkpoint-state rules
(nothing is spawned; the multi-process behaviour is in test_strategy_training/names/checkpoint.py)."""

from __future__ import annotations

import inspect
import sys
import typing

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_ddpx import DDPXStrategy, checkpoint_state
from lightning_ddpx.hooks import PowerSGDOptions
from lightning_ddpx.lightning.checkpoints.checkpoint_state import Restore, check_plain, select_for_rank
from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPXStrategy
from tests.dist_utils import run_job


# ------------------------------------------------------------------------------------------ arguments
def test_accepts_every_ddp_strategy_argument():
    ours = inspect.signature(DDPXStrategy.__init__).parameters
    lightning = inspect.signature(DDPStrategy.__init__).parameters
    assert set(lightning) <= set(ours)  # torch DDP kwargs: tests/lightning/test_ddp_kwargs.py
    for name in ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                 "process_group_backend", "timeout", "start_method"):  # fmt: skip
        assert ours[name].default == lightning[name].default, name


def test_every_argument_is_type_hinted_for_lightning_cli():
    hints = typing.get_type_hints(DDPXStrategy.__init__)
    missing = [
        name
        for name in inspect.signature(DDPXStrategy.__init__).parameters
        if name != "self" and name not in hints
    ]
    assert missing == []
    assert hints["return"] is type(None)


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (
            {"comm_hook": "powersdg"},
            ValueError,
            r"unknown comm_hook 'powersdg'. Registered names: .*powersgd",
        ),
        ({"comm_hook": 3}, TypeError, "registered name or a callable"),
        ({"comm_wrapper": "fp16"}, ValueError, "comm_wrapper='fp16' wraps a hook, but comm_hook is None"),
        ({"comm_hook": "powersgd", "comm_wrapper": "fp8"}, ValueError, "comm_wrapper must be one of"),
        ({"comm_hook": "powersgd", "comm_state": object()}, ValueError, "comm_state is for callable hooks"),
        ({"comm_state": object()}, ValueError, "comm_state is given but comm_hook is None"),
        ({"comm_hook": "fp16", "powersgd": {}}, ValueError, "'fp16', which takes none"),
        ({"powersgd": {"matrix_approximation_rank": 2}}, ValueError, "comm_hook is None, which takes none"),
        (
            {"comm_hook": "powersgd", "powersgd": {"rank": 2}},
            ValueError,
            r"unknown PowerSGD option\(s\) \['rank'\]",
        ),
        (
            {"comm_hook": "powersgd", "powersgd": {"start_powerSGD_iter": 1}},
            ValueError,
            "start_powerSGD_iter >= 2",
        ),
        ({"comm_hook": "powersgd", "powersgd": [1]}, TypeError, "PowerSGDOptions or a dict"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a positive number"),
        ({"first_bucket_cap_mb": -1.0}, ValueError, "first_bucket_cap_mb must be a positive number"),
    ],
)
def test_bad_arguments_fail_in_the_constructor(arguments, error, match):
    with pytest.raises(error, match=match):
        DDPXStrategy(**arguments)


def test_a_string_that_is_not_a_registered_name_is_imported():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    path = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook"
    assert DDPXStrategy(comm_hook=path).comm_hook is default_hooks.fp16_compress_hook
    with pytest.raises(ValueError, match=r"unknown comm_hook 'no_such.hook'.*Importing it failed"):
        DDPXStrategy(comm_hook="no_such.hook")
    with pytest.raises(ValueError, match="is a int, not a callable"):
        DDPXStrategy(comm_hook="lightning_ddpx.lightning.checkpoints.checkpoint_state.FORMAT_VERSION")


def test_powersgd_options_as_dict_or_dataclass():
    from_dict = DDPXStrategy(comm_hook="powersgd", powersgd={"matrix_approximation_rank": 4})
    assert from_dict.powersgd == PowerSGDOptions(matrix_approximation_rank=4)
    options = PowerSGDOptions(matrix_approximation_rank=2, start_powerSGD_iter=10)
    assert DDPXStrategy(comm_hook="batched_powersgd", powersgd=options).powersgd is options


def test_hook_names_identify_hook_and_wrapper():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert DDPXStrategy().hook_name == "allreduce"
    assert DDPXStrategy(comm_hook="powersgd").hook_name == "powersgd"
    assert DDPXStrategy(comm_hook="powersgd", comm_wrapper="fp16").hook_name == "fp16(powersgd)"
    callable_hook = DDPXStrategy(comm_hook=default_hooks.allreduce_hook)
    assert (
        callable_hook.hook_name == "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook"
    )


# ------------------------------------------------------------------------------------------ registry
HOOK_SHORTCUTS = {"ddpx_fp16": {"comm_hook": "fp16"}, "ddpx_powersgd": {"comm_hook": "powersgd"}}


def lightning_ddp_names(registry) -> dict[str, dict]:
    """Lightning's own DDP names in ``registry`` ("ddp", "ddp_fork", ...) and their ``init_params``."""
    return {
        name: entry["init_params"]
        for name, entry in registry.items()
        if entry["strategy"] in (DDPStrategy, FabricDDPStrategy)
    }


def ddpx_names(registry) -> dict[str, dict]:
    return {name: entry["init_params"] for name, entry in registry.items() if name.startswith("ddpx")}


@pytest.mark.parametrize("registry", [StrategyRegistry, STRATEGY_REGISTRY], ids=["Trainer", "Fabric"])
def test_every_lightning_ddp_name_has_its_ddpx_twin_with_the_same_init_params(registry):
    """Oracle: Lightning's registry. Each "ddp..." name is registered as "ddpx..." with the same arguments
    (start_method, find_unused_parameters); ours add only the hook shortcuts."""
    theirs = lightning_ddp_names(registry)
    assert {"ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true"} <= set(theirs)
    expected = {"ddpx" + name[3:]: params for name, params in theirs.items()} | HOOK_SHORTCUTS
    assert ddpx_names(registry) == expected
    ours = FabricDDPXStrategy if registry is STRATEGY_REGISTRY else DDPXStrategy
    assert all(registry[name]["strategy"] is ours for name in expected)


@pytest.mark.parametrize("name", sorted(ddpx_names(StrategyRegistry)))
def test_registered_names_build_our_strategy_as_lightning_builds_its_own(name):
    ours = StrategyRegistry.get(name)
    assert type(ours) is DDPXStrategy
    if name in HOOK_SHORTCUTS:
        assert ours.comm_hook == HOOK_SHORTCUTS[name]["comm_hook"] and ours._start_method == "popen"
        return
    theirs = StrategyRegistry.get("ddp" + name[4:])
    assert type(theirs) is DDPStrategy
    assert ours._start_method == theirs._start_method
    assert ours.find_unused_parameters == theirs._ddp_kwargs.get("find_unused_parameters", False)
    assert ours._ddp_kwargs == theirs._ddp_kwargs  # where Lightning keeps torch DDP's arguments
    assert ours.comm_hook is None


@pytest.mark.processes
def test_import_lightning_ddpx_registers_the_names():
    code = (
        "import lightning_ddpx\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "print(sorted(n for n in StrategyRegistry if n.startswith('ddpx')))\n"
        "print(sorted(n for n in STRATEGY_REGISTRY if n.startswith('ddpx')))\n"
        "print(lightning_ddpx.DDPXStrategy.__module__)\n"
    )
    done = run_job([sys.executable, "-c", code], timeout=120)
    assert done.returncode == 0, done.stderr
    output = done.stdout.splitlines()
    assert output == [
        repr(sorted(ddpx_names(StrategyRegistry))),
        repr(sorted(ddpx_names(STRATEGY_REGISTRY))),
        "lightning_ddpx.lightning.strategies.trainer",
    ]


def test_registering_again_is_harmless():
    DDPXStrategy.register_strategies(StrategyRegistry)
    assert type(StrategyRegistry.get("ddpx")) is DDPXStrategy


# ---------------------------------------------------------------------------------- checkpoint rules
ENTRY = {
    "format": 1,
    "hook": "powersgd",
    "world_size": 2,
    "shared": {"iteration": 8},
    "per_rank": [{"error": {0: torch.zeros(3)}}, {"error": {0: torch.ones(3)}}],
}


def test_same_hook_and_world_size_restores_this_ranks_part():
    restore = select_for_rank(ENTRY, "powersgd", stateful=True, rank=1, world_size=2)
    assert restore.warning is None
    assert restore.state_dict["shared"] == {"iteration": 8}
    assert torch.equal(restore.state_dict["per_rank"]["error"][0], torch.ones(3))


def test_other_world_size_keeps_shared_part_and_warns():
    restore = select_for_rank(ENTRY, "powersgd", stateful=True, rank=0, world_size=4)
    assert restore.state_dict == {"shared": {"iteration": 8}, "per_rank": {}}
    assert "written by 2 processes and this run has 4" in restore.warning


@pytest.mark.parametrize(
    "entry, hook, stateful, warning",
    [
        (None, "powersgd", True, "holds no communication-hook state"),
        (None, "allreduce", False, None),
        (
            ENTRY,
            "fp16(powersgd)",
            True,
            "written with comm hook 'powersgd', but this run uses 'fp16(powersgd)'",
        ),
        ({**ENTRY, "format": 99}, "powersgd", True, "has format 99"),
        ("garbage", "powersgd", True, "has format 'str'"),
        ({**ENTRY, "hook": "allreduce", "shared": None, "per_rank": None}, "allreduce", False, None),
    ],
)
def test_mismatches_restore_nothing(entry, hook, stateful, warning):
    restore = select_for_rank(entry, hook, stateful, rank=0, world_size=2)
    assert restore.state_dict is None
    assert (restore.warning is None) if warning is None else (warning in restore.warning)


def test_apply_restore_passes_the_selection_to_load_state_dict():
    class State:
        loaded = None

        def state_dict(self):
            return {"shared": {}, "per_rank": {}}

        def load_state_dict(self, sd):
            self.loaded = sd

    state = State()
    assert checkpoint_state.is_stateful(state) and not checkpoint_state.is_stateful(None)
    checkpoint_state.apply_restore(state, Restore(None, "warning"))
    assert state.loaded is None
    checkpoint_state.apply_restore(state, Restore({"shared": {"a": 1}, "per_rank": {}}, None))
    assert state.loaded == {"shared": {"a": 1}, "per_rank": {}}


def test_check_plain_accepts_what_weights_only_loads_and_names_the_rest():
    check_plain({"a": [1, 2.0, "x", None, True, torch.zeros(2)], 3: (b"raw",)}, "state")
    with pytest.raises(TypeError, match=r"state\['rng'\] is a numpy.random.*RandomState"):
        import numpy as np

        check_plain({"rng": np.random.RandomState(0)}, "state")
    with pytest.raises(TypeError, match="has a key of type tuple"):
        check_plain({(1, 2): 0}, "state")


def test_strategy_pickles_for_spawn_without_a_pending_restore():
    import pickle

    strategy = DDPXStrategy(comm_hook="powersgd", powersgd={"start_powerSGD_iter": 10})
    copy = pickle.loads(pickle.dumps(strategy))  # what ddpx_spawn does to reach its processes
    assert copy._pending_hook_entry is None
    assert copy.comm_hook == "powersgd" and copy.powersgd == strategy.powersgd


def test_checkpoints_are_written_atomically_by_default() -> None:
    """Both strategies default to AtomicCheckpointIO; a CheckpointIO the user gives wins, without conflict."""
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins import AsyncCheckpointIO

    from lightning_ddpx import AtomicCheckpointIO
    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPXStrategy

    assert type(DDPXStrategy().checkpoint_io) is AtomicCheckpointIO
    assert type(FabricDDPXStrategy().checkpoint_io) is AtomicCheckpointIO
    given = TorchCheckpointIO()
    assert DDPXStrategy(checkpoint_io=given).checkpoint_io is given
    assert FabricDDPXStrategy(checkpoint_io=given).checkpoint_io is given
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=DDPXStrategy(), plugins=[TorchCheckpointIO()], logger=False
    )
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=DDPXStrategy(), plugins=[AsyncCheckpointIO()], logger=False
    )
    io = trainer.strategy.checkpoint_io
    assert isinstance(io, AsyncCheckpointIO) and type(io.checkpoint_io) is AtomicCheckpointIO
    io.teardown()
