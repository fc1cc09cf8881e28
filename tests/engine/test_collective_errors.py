"""Every collective lightning_ddpx issues reports a vanished peer as our named error, and ranks configured
with different hooks or options are stopped before the first step with a message naming the setting.

Per site: rank 1 leaves the job (returns, destroying its process group) just before the site, and rank 0
runs it. Rank 0 must raise :class:`~lightning_ddpx.engine.agreement.errors.CommunicationError` naming what it was doing and
the peer, not gloo's bare "Connection reset by peer" (tests/engine/test_no_hangs.py covers bucket reductions).
Not reachable here, though wrapped the same way: the bfloat16 probe (gloo is known to reduce bfloat16, so
it never probes), the used-parameter bitmap (bucket reductions before it fail first) and the weight
broadcast before validate/test/predict (Lightning's own collectives run before it).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import lightning_ddpx
import lightning_ddpx.hooks.model_averaging
import lightning_ddpx.lightning.checkpoints.local_replicas
from lightning_ddpx.engine.agreement.errors import CommunicationError
from lightning_ddpx.engine.transport.transports import MeanAllReduce
from lightning_ddpx.lightning.settings.config import DDPXConfig
from tests.dist_utils import run_distributed
from tests.engine.test_engine_oracle import SMALL_BUCKETS, conv_bn, conv_loss

PG_TIMEOUT_S = 6.0


def _steps(model: nn.Module, count: int) -> None:
    for step in range(count):
        conv_loss(model, step).backward()


def _powersgd_module() -> tuple[DDPXConfig, lightning_ddpx.DistributedDataParallel, Any]:
    config = DDPXConfig(comm_hook="powersgd", powersgd={"start_powerSGD_iter": 2}, **SMALL_BUCKETS)
    module = config.wrap(conv_bn())
    return config, module, config.register_hook(module)


def _site_construction(rank: int) -> None:
    lightning_ddpx.DistributedDataParallel(conv_bn(), **SMALL_BUCKETS)


def _site_rebuild(rank: int):
    model = lightning_ddpx.DistributedDataParallel(conv_bn(), **SMALL_BUCKETS)
    _steps(model, 1)
    return model


def _site_buffers(rank: int):
    model = lightning_ddpx.DistributedDataParallel(conv_bn(), **SMALL_BUCKETS)
    _steps(model, 2)  # past the settings check and the rebuild: the next forward only broadcasts buffers
    return model


def _site_checkpoint(rank: int):
    config, module, state = _powersgd_module()
    _steps(module, 3)
    return config, module, state


def _site_model_averaging(rank: int):
    return lightning_ddpx.DistributedDataParallel(conv_bn(), **SMALL_BUCKETS)


# site -> (what each rank builds before rank 1 leaves, what rank 0 then runs, text the error must name)
SITES: dict[str, tuple[Any, Any, str]] = {
    "construction": (lambda rank: None, _site_construction, "every rank to describe its model"),
    "settings check": (
        lambda rank: lightning_ddpx.DistributedDataParallel(conv_bn(), **SMALL_BUCKETS),
        lambda model: conv_loss(model, 0),
        "every rank to compare its settings",
    ),
    "bucket rebuild": (_site_rebuild, lambda model: conv_loss(model, 1), "gradient ready order to rebuild"),
    "buffer broadcast": (_site_buffers, lambda model: conv_loss(model, 2), "rank 0's buffers before forward"),
    "checkpoint hook state": (
        _site_checkpoint,
        lambda built: built[0].hook_entry(built[2], built[1].process_group, built[1].reducer_state_dict()),
        "state of comm hook 'powersgd'",
    ),
    "model averaging": (
        _site_model_averaging,
        lambda model: lightning_ddpx.hooks.model_averaging.average_parameters(model.parameters()),
        "parameters to average",
    ),
    "local replicas": (
        lambda rank: None,
        lambda _: lightning_ddpx.lightning.checkpoints.local_replicas.gather_replicas(
            {"weights": torch.ones(2)}
        ),
        "own weights and optimizer state",
    ),
}


def peer_leaves_before(rank: int, world_size: int, site: str) -> dict:
    prepare, run, _ = SITES[site]
    torch.manual_seed(0)
    built = prepare(rank)
    if rank == 1:
        return {"rank": 1}
    try:
        run(built if site != "construction" else rank)
    except CommunicationError as error:
        return {"rank": 0, "type": "CommunicationError", "message": str(error)}
    except Exception as error:  # noqa: BLE001 - the test reports which kind of error escaped instead
        return {"rank": 0, "type": type(error).__name__, "message": str(error)}
    return {"rank": 0, "type": None, "message": "no error"}


@pytest.mark.slow
@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.processes
def test_a_vanished_peer_is_reported_as_our_error_at_every_site(site: str) -> None:
    result = run_distributed(peer_leaves_before, 2, site, pg_timeout=PG_TIMEOUT_S, timeout=120)[0]
    message = result["message"]
    assert result["type"] == "CommunicationError", result
    assert message.startswith("lightning_ddpx (rank 0)"), message
    assert SITES[site][2] in message, message
    assert "the other rank (rank 1)" in message, message


# ------------------------------------------------------------------------- settings agreement
class OtherPath(MeanAllReduce):
    """The default collectives under another description: what a benchmark's injected transport looks like."""

    def describe(self) -> str:
        return "another path (a benchmark's)"


def configured_per_rank(rank: int, world_size: int, options_per_rank: list[dict]) -> dict:
    options = dict(options_per_rank[rank])
    os.environ.update(options.pop("_env", {}))
    injected = options.pop("_transport", None)
    config = DDPXConfig(**options)
    module = config.wrap(conv_bn())
    config.register_hook(module)
    if injected is not None:  # what a benchmark does: another path than the one construction chose
        module.reducer.use_transport(injected(module.process_group))
    try:
        conv_loss(module, 0).backward()
    except ValueError as error:
        return {"raised": True, "message": str(error), "steps": module.reducer.iterations_synced}
    return {"raised": False, "message": "", "steps": module.reducer.iterations_synced}


MISMATCHES = {
    "hook": (
        [{"comm_hook": "powersgd"}, {"comm_hook": "allreduce"}],
        "Setting 'comm_hook' differs: rank 0: lightning_ddpx.hooks.powersgd.powersgd_hook; "
        "rank 1: lightning_ddpx.hooks.default.allreduce_hook",
    ),
    "hook on one rank only": ([{"comm_hook": "fp16"}, {}], "Setting 'comm_hook' differs"),
    "hook option": (
        [{"comm_hook": "powersgd", "powersgd": {"matrix_approximation_rank": r}} for r in (1, 2)],
        "Setting 'comm_hook option matrix_approximation_rank' differs: rank 0: 1; rank 1: 2",
    ),
    "wrapper": (
        [{"comm_hook": "powersgd", "comm_wrapper": "fp16"}, {"comm_hook": "powersgd"}],
        "Setting 'comm_hook' differs",
    ),
    "bucket cap": ([{"bucket_cap_mb": 1.0}, {"bucket_cap_mb": 2.0}], "Setting 'bucket_cap_mb' differs"),
    "find_unused_parameters": (
        [{"find_unused_parameters": True}, {}],
        "Setting 'find_unused_parameters' differs: rank 0: True; rank 1: False",
    ),
    "gradient_as_bucket_view": (
        [{}, {"gradient_as_bucket_view": True}],
        "Setting 'gradient_as_bucket_view' differs",
    ),
    # what changes the collectives beyond the module's own options
    "transport injected on one rank": (
        [{"_transport": OtherPath}, {}],
        "Setting 'transport' differs: rank 0: another path (a benchmark's)",
    ),
    "DDPX_DEBUG on one rank": (
        [{"_env": {"DDPX_DEBUG": "1"}}, {"_env": {"DDPX_DEBUG": "0"}}],
        "Setting 'DDPX_DEBUG' differs: rank 0: True; rank 1: False",
    ),
    "uneven_inputs": (
        [{"uneven_inputs": "off"}, {}],
        "Setting 'uneven_inputs' differs: rank 0: 'off'",
    ),
    "verify_replicas_every_n_steps": (
        [{"verify_replicas_every_n_steps": 10}, {}],
        "Setting 'verify_replicas_every_n_steps' differs: rank 0: 10",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MISMATCHES))
@pytest.mark.processes
def test_ranks_configured_differently_fail_before_the_first_step(case: str) -> None:
    options, expected = MISMATCHES[case]
    results = run_distributed(configured_per_rank, 2, options, pg_timeout=PG_TIMEOUT_S, timeout=120)
    for rank, result in enumerate(results):
        assert result["raised"], f"rank {rank} trained with mismatched settings: {result}"
        assert result["steps"] == 0, result
        assert expected in result["message"], result["message"]
        assert "Give every rank the same options" in result["message"]


@pytest.mark.slow
@pytest.mark.processes
def test_equal_settings_pass_the_check() -> None:
    options = [{"comm_hook": "powersgd", "powersgd": {"matrix_approximation_rank": 2}}] * 2
    results = run_distributed(configured_per_rank, 2, options, pg_timeout=PG_TIMEOUT_S, timeout=120)
    assert [r["raised"] for r in results] == [False, False], results
    assert [r["steps"] for r in results] == [1, 1]


def test_setting_difference_message_groups_ranks() -> None:
    from lightning_ddpx.engine.agreement.consistency import describe_setting_difference

    message = describe_setting_difference(
        [
            {"comm_hook": "a", "bucket_cap_mb": "1"},
            {"comm_hook": "b", "bucket_cap_mb": "1"},
            {"comm_hook": "a", "bucket_cap_mb": "2"},
        ]  # fmt: skip
    )
    assert "Setting 'bucket_cap_mb' differs: ranks 0, 1: 1; rank 2: 2." in message
    assert "Other settings that differ: comm_hook." in message


def trainer_with_hook_per_rank(rank: int, world_size: int, hooks: list[str]) -> dict:
    from tests.strategy_helpers import fit, quiet

    quiet()
    try:
        fit(lightning_ddpx.DDPXStrategy(comm_hook=hooks[rank]), max_steps=4)
    except ValueError as error:
        return {"raised": True, "message": str(error)}
    return {"raised": False, "message": ""}


@pytest.mark.slow
@pytest.mark.processes
def test_trainer_with_another_hook_on_one_rank_fails_before_training() -> None:
    """The reported mistake: comm_hook='powersgd' on rank 0, 'allreduce' on rank 1. Both ranks raise the
    same ValueError at the first forward, instead of a gloo abort on one and a timeout on the other."""
    results = run_distributed(
        trainer_with_hook_per_rank, 2, ["powersgd", "allreduce"], init_process_group=False, timeout=180
    )
    for result in results:
        assert result["raised"], result
        assert "Setting 'comm_hook' differs" in result["message"], result["message"]
        assert "powersgd_hook" in result["message"] and "allreduce_hook" in result["message"]
