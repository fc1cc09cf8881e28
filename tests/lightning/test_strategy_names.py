"""Every registered strategy name and every hook name trains end to end in ``Trainer.fit``; a parameter
without gradient fails with an error that names it and the fix.

A tiny model and a few steps per run, all runs of a kind in one 2-process job.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.strategy_helpers import TinyRegressor, fit, parameters_of, quiet

pytestmark = [pytest.mark.slow, pytest.mark.processes]

STEPS = 4
REGISTERED = ("ddpx", "ddpx_find_unused_parameters_true", "ddpx_fp16", "ddpx_powersgd")
EARLY_POWERSGD = {"start_powerSGD_iter": 2}  # compress from step 2 of 4


def hook_configurations() -> dict[str, dict]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "allreduce": {"comm_hook": "allreduce"},
        "fp16": {"comm_hook": "fp16"},
        "bf16": {"comm_hook": "bf16"},
        "powersgd": {"comm_hook": "powersgd", "powersgd": EARLY_POWERSGD},
        "batched_powersgd": {"comm_hook": "batched_powersgd", "powersgd": EARLY_POWERSGD},
        "fp16(powersgd)": {"comm_hook": "powersgd", "powersgd": EARLY_POWERSGD, "comm_wrapper": "fp16"},
        "noop": {"comm_hook": "noop"},
        "torch allreduce_hook": {"comm_hook": default_hooks.allreduce_hook},
        "bf16(torch allreduce_hook)": {"comm_hook": default_hooks.allreduce_hook, "comm_wrapper": "bf16"},
    }


def names_job(rank: int, world_size: int) -> dict:
    quiet()
    from lightning_ddpx import DDPXStrategy

    out: dict = {"initial": parameters_of(TinyRegressor())}
    for name in REGISTERED:
        trainer, model = fit(name, max_steps=STEPS)
        out[name] = {"class": type(trainer.strategy).__name__, "hook": trainer.strategy.hook_name}
        out[name]["params"] = parameters_of(model)
        out[name]["steps"] = trainer.global_step
    for label, arguments in hook_configurations().items():
        trainer, model = fit(DDPXStrategy(**arguments), max_steps=STEPS)
        out[label] = {"params": parameters_of(model), "steps": trainer.global_step}
        out[label]["hook"] = trainer.strategy.hook_name
        state = trainer.strategy.comm_hook_state
        out[label]["iteration"] = getattr(state, "iter", None)
    _, model = fit("ddp", max_steps=STEPS)
    out["ddp"] = {"params": parameters_of(model)}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(names_job, 2, init_process_group=False, timeout=300, pg_timeout=120)


@pytest.mark.parametrize("name", REGISTERED)
def test_registered_name_trains(results, name):
    for rank_result in results:
        run = rank_result[name]
        assert run["class"] == "DDPXStrategy" and run["steps"] == STEPS
        for key, value in run["params"].items():
            assert torch.isfinite(value).all()
            assert not torch.equal(value, rank_result["initial"][key]), f"{name} did not train {key}"
        for key, value in run["params"].items():  # ranks stay in step
            assert torch.equal(value, results[0][name]["params"][key])
    assert results[0]["ddpx_fp16"]["hook"] == "fp16" and results[0]["ddpx_powersgd"]["hook"] == "powersgd"


@pytest.mark.parametrize(
    "label, tolerance",
    [
        ("allreduce", 1e-6),
        ("torch allreduce_hook", 1e-6),
        ("fp16", 1e-2),
        ("bf16", 5e-2),
        ("bf16(torch allreduce_hook)", 5e-2),
        ("powersgd", None),
        ("batched_powersgd", None),
        ("fp16(powersgd)", None),
    ],
)
def test_hook_trains_and_keeps_ranks_in_step(results, label, tolerance):
    reference = results[0]["ddp"]["params"]
    for rank_result in results:
        run = rank_result[label]
        assert run["steps"] == STEPS
        for key, value in run["params"].items():
            assert torch.isfinite(value).all()
            assert torch.equal(value, results[0][label]["params"][key]), f"{label}: ranks differ on {key}"
            if tolerance is not None:  # exact or compressed averages stay close to torch's DDP
                torch.testing.assert_close(value, reference[key], rtol=tolerance, atol=tolerance)
    if "powersgd" in label:
        assert results[0][label]["iteration"] == STEPS


def test_noop_hook_runs_without_averaging(results):
    # noop returns each rank's own gradient: it runs, and ranks drift apart (headroom analysis only).
    params = [r["noop"]["params"] for r in results]
    assert any(not torch.equal(params[0][k], params[1][k]) for k in params[0])


def unused_parameter_job(rank: int, world_size: int) -> None:
    quiet()
    from datetime import timedelta

    from lightning_ddpx import DDPXStrategy
    from tests.strategy_helpers import BranchUnusedOnRank1

    fit(DDPXStrategy(timeout=timedelta(seconds=20)), max_steps=2, model_cls=BranchUnusedOnRank1)


def test_unused_parameter_error_names_it_and_the_fix():
    with pytest.raises(AssertionError) as failure:
        run_distributed(unused_parameter_job, 2, init_process_group=False, timeout=120)
    message = str(failure.value)
    assert "rank 1 failed first" in message  # the rank where the branch is skipped
    assert "'extra.weight'" in message and "'extra.bias'" in message
    assert "find_unused_parameters=True" in message and "ddpx_find_unused_parameters_true" in message


class ExtraNeverUsed(TinyRegressor):
    """``extra`` never takes part in the loss, on any rank: the same error on every rank, no hang."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(4, 4)


def unused_everywhere_job(rank: int, world_size: int) -> dict:
    quiet()
    from datetime import timedelta

    from lightning_ddpx import DDPXStrategy

    messages = {}
    for label, strategy in (("ddp", "ddp"), ("ddpx", DDPXStrategy(timeout=timedelta(seconds=20)))):
        try:  # torch's DDP raises in the second forward, ours at the end of the first backward
            fit(strategy, max_steps=2, model_cls=ExtraNeverUsed)
        except RuntimeError as error:
            messages[label] = str(error)
    return messages


def test_unused_parameter_error_keeps_ours_and_says_what_lightning_says():
    """Oracle: the message of Lightning's ``ddp`` (its DDPStrategy replaces torch's). Ours keeps our
    text (parameter, rank, fix) and contains Lightning's, in our names -- users search for that sentence."""
    results = run_distributed(unused_everywhere_job, 2, init_process_group=False, timeout=240)
    for rank, messages in enumerate(results):
        theirs, ours = messages["ddp"], messages["ddpx"]
        sentence = (
            "It looks like your LightningModule has parameters that were not used in producing the loss"
        )
        assert theirs.startswith(sentence)
        in_our_names = theirs.replace(
            "'ddp_find_unused_parameters_true'", "'ddpx_find_unused_parameters_true'"
        )
        in_our_names = in_our_names.replace("DDPStrategy(", "DDPXStrategy(")
        assert in_our_names in ours
        assert f"on rank {rank}, parameter(s) 'extra.weight', 'extra.bias'" in ours  # ours, kept


def test_spawn_name_trains_from_the_main_process(tmp_path, monkeypatch):
    """``ddpx_spawn``: Lightning itself starts the 2 processes (start_method="spawn")."""
    import lightning_ddpx.lightning.strategies.trainer  # noqa: F401 - registers the names
    from tests.strategy_helpers import make_trainer

    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    quiet()
    torch.manual_seed(0)
    model = TinyRegressor()
    before = parameters_of(model)
    trainer = make_trainer("ddpx_spawn", max_steps=2, default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    assert type(trainer.strategy).__name__ == "DDPXStrategy" and trainer.strategy._start_method == "spawn"
    after = parameters_of(model)  # Lightning copies rank 0's trained weights back into this process
    assert all(not torch.equal(after[k], before[k]) for k in before)


def test_notebook_names_fork_and_train_like_lightnings_in_an_interactive_session(tmp_path):
    """``ddpx_notebook`` (what Jupyter and Colab users select; ``ddpx_fork`` is the same) forks 2 real CPU
    processes from an interactive session, as Lightning's ``ddp_notebook`` does, and trains to the same
    weights, with the Trainer and with Fabric; training again in the same session works too; ``ddpx`` is
    refused there, as ``ddp`` is."""
    import sys

    from tests.dist_utils import run_job

    out = tmp_path / "notebook.pt"
    done = run_job([sys.executable, "-m", "tests.jobs.notebook_job", str(out)], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    assert result["interactive"] is True
    theirs = result["ddp_notebook"]
    for label in ("ddpx_notebook", "ddpx_notebook again"):
        ours = result[label]
        assert ours["class"] == "DDPXStrategy" and ours["start_method"] == theirs["start_method"] == "fork"
        for key, value in theirs["params"].items():  # rank 0's weights, copied back into the session
            assert not torch.equal(ours["params"][key], result["initial"][key]), (
                f"{label} did not train {key}"
            )
            torch.testing.assert_close(ours["params"][key], value, rtol=0, atol=1e-6)
    theirs, ours = result["fabric ddp_notebook"], result["fabric ddpx_notebook"]
    assert ours["class"] == "DDPXStrategy"
    for key, value in theirs["params"].items():  # Fabric: rank 0's return value, from the forked process
        torch.testing.assert_close(torch.tensor(ours["params"][key]), torch.tensor(value), rtol=0, atol=1e-6)
    assert result["threads"] == []  # the session itself runs no lightning_ddpx thread
    assert "is not compatible with an interactive environment" in result["ddpx"]
