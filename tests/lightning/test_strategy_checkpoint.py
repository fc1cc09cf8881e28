"""Hook state in Lightning checkpoints: exact resume with PowerSGD, safe loading, and resumes that cannot
restore everything (other hook, no hook state, other world size) warn instead of failing.

Training: 2 epochs of 8 steps per rank. PowerSGD compresses from step 2, so at the checkpoint (end of
epoch 1) it holds warm-start Q memory, an iteration count and per-rank error feedback. The checkpoint is
written at an epoch boundary because Lightning restarts an interrupted epoch's data from its beginning.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.dist_utils import run_distributed
from tests.strategy_helpers import TinyRegressor, fit, parameters_of, quiet

pytestmark = [pytest.mark.slow, pytest.mark.processes]

POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
EPOCH_STEPS = 8  # 64 samples / 2 ranks / batch 4


class DeclaredOutputFirst(TinyRegressor):
    """Output layer declared first: the initial buckets (reverse declaration order) differ from the ones
    rebuilt after the first step (the order gradients became ready)."""

    def __init__(self) -> None:
        super().__init__()
        del self.net
        self.out = torch.nn.Linear(16, 4)
        self.inp = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def powersgd_strategy():
    from lightning_ddpx import DDPXStrategy

    return DDPXStrategy(comm_hook="powersgd", powersgd=POWERSGD)


def fit_recording_warnings(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model = fit(*args, **kwargs)
    return trainer, model, [str(w.message) for w in caught if "lightning_ddpx" in str(w.message)]


def resume_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    from lightning_ddpx import DDPXStrategy

    out: dict = {}
    # Reference: 2 epochs without interruption.
    trainer, model = fit(powersgd_strategy(), max_steps=-1, max_epochs=2)
    out["continuous"] = parameters_of(model)
    out["continuous/iteration"] = trainer.strategy.comm_hook_state.iter

    # 1 epoch, checkpoint at its end, then a new Trainer and a fresh model resume for the second epoch.
    checkpoint = ModelCheckpoint(dirpath=directory, filename="powersgd-{epoch}", save_on_train_epoch_end=True)
    fit(powersgd_strategy(), max_steps=-1, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint])
    path = os.path.join(directory, "powersgd-epoch=0.ckpt")
    out["path"] = path
    trainer, model, out["resumed/warnings"] = fit_recording_warnings(
        powersgd_strategy(),
        max_steps=-1,
        max_epochs=2,
        ckpt_path=path,  # same seed: it also seeds the sampler
    )
    out["resumed"] = parameters_of(model)
    out["resumed/iteration"] = trainer.strategy.comm_hook_state.iter

    # trainer.save_checkpoint after fit still holds every rank's hook state.
    after_fit = os.path.join(directory, "after-fit.ckpt")
    trainer.save_checkpoint(after_fit)
    out["after_fit_path"] = after_fit

    # A checkpoint written with another hook: resumes, with a warning, and the model is restored.
    _, _, out["other_hook/warnings"] = fit_recording_warnings(
        DDPXStrategy(comm_hook="fp16"), max_steps=-1, max_epochs=2, ckpt_path=path
    )
    # A checkpoint without hook state (written by Lightning's own DDP strategy).
    ddp_checkpoint = ModelCheckpoint(dirpath=directory, filename="ddp-{epoch}", save_on_train_epoch_end=True)
    fit("ddp", max_steps=-1, max_epochs=1, enable_checkpointing=True, callbacks=[ddp_checkpoint])
    trainer, _, out["no_state/warnings"] = fit_recording_warnings(
        powersgd_strategy(), max_steps=-1, max_epochs=2, ckpt_path=os.path.join(directory, "ddp-epoch=0.ckpt")
    )
    out["no_state/iteration"] = trainer.strategy.comm_hook_state.iter

    # The same exact-resume check on a model whose parameters are declared in another order than backward
    # produces their gradients (the checkpoint carries the bucket layout, so the first resumed step reduces the same buckets).
    _, model = fit(powersgd_strategy(), max_steps=-1, max_epochs=2, model_cls=DeclaredOutputFirst)
    out["reordered/continuous"] = parameters_of(model)
    checkpoint = ModelCheckpoint(
        dirpath=directory, filename="reordered-{epoch}", save_on_train_epoch_end=True
    )
    fit(
        powersgd_strategy(),
        max_steps=-1,
        max_epochs=1,
        model_cls=DeclaredOutputFirst,
        enable_checkpointing=True,
        callbacks=[checkpoint],
    )
    _, model, out["reordered/warnings"] = fit_recording_warnings(
        powersgd_strategy(),
        max_steps=-1,
        max_epochs=2,
        model_cls=DeclaredOutputFirst,
        ckpt_path=os.path.join(directory, "reordered-epoch=0.ckpt"),
    )
    out["reordered/resumed"] = parameters_of(model)
    return out


def other_world_size_job(rank: int, world_size: int, path: str) -> dict:
    quiet()
    trainer, _, messages = fit_recording_warnings(
        powersgd_strategy(), max_steps=-1, max_epochs=2, ckpt_path=path, devices=world_size
    )
    return {"warnings": messages, "iteration": trainer.strategy.comm_hook_state.iter}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    return run_distributed(resume_job, 2, directory, init_process_group=False, timeout=300, pg_timeout=120)


def test_resume_is_bit_identical_to_uninterrupted_training(results):
    for rank_result in results:
        assert rank_result["resumed/warnings"] == []
        assert rank_result["resumed/iteration"] == rank_result["continuous/iteration"] == 2 * EPOCH_STEPS
        for name, expected in rank_result["continuous"].items():
            assert torch.equal(rank_result["resumed"][name], expected), name


def test_checkpoint_loads_with_weights_only_and_holds_every_rank(results):
    for key in ("path", "after_fit_path"):
        checkpoint = torch.load(results[0][key], weights_only=True)
        entry = checkpoint["lightning_ddpx"]
        assert entry["format"] == 1 and entry["hook"] == "powersgd" and entry["world_size"] == 2
        assert entry["shared"]["iteration"] == (EPOCH_STEPS if key == "path" else 2 * EPOCH_STEPS)
        assert entry["shared"]["q"], "warm-start memory is saved once, in the shared part"
        per_rank = entry["per_rank"]
        assert len(per_rank) == 2, "one error-feedback entry per rank"
        errors = [part["error"] for part in per_rank]
        assert errors[0] and errors[0].keys() == errors[1].keys()
        bucket = next(iter(errors[0]))
        assert not torch.equal(errors[0][bucket], errors[1][bucket]), "ranks' residuals differ: both are kept"


def test_checkpoint_of_other_hook_resumes_with_a_warning(results):
    (message,) = results[0]["other_hook/warnings"]  # rank_zero_warn: once, on rank 0
    assert "written with comm hook 'powersgd'" in message and "'fp16'" in message
    assert results[1]["other_hook/warnings"] == []


def test_checkpoint_without_hook_state_resumes_with_a_warning(results):
    (message,) = results[0]["no_state/warnings"]
    assert "holds no communication-hook state" in message
    for rank_result in results:
        assert rank_result["no_state/iteration"] == EPOCH_STEPS  # the hook counted only the resumed epoch


def test_other_world_size_keeps_shared_state_and_resets_error_feedback(results):
    (result,) = run_distributed(
        other_world_size_job, 1, results[0]["path"], init_process_group=False, timeout=120
    )
    (message,) = result["warnings"]
    assert "written by 2 processes and this run has 1" in message
    # The shared iteration count continued from the checkpoint (8), then the second epoch ran 16 steps
    # on one process (all 64 samples, batch 4).
    assert result["iteration"] == EPOCH_STEPS + 16


def test_resume_is_exact_when_declaration_order_differs_from_gradient_order(results):
    for rank_result in results:
        for name, expected in rank_result["reordered/continuous"].items():
            assert torch.equal(rank_result["reordered/resumed"][name], expected), name
