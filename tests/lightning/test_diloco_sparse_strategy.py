"""DiLoCo's sparse exchange through the Trainer strategy, Fabric and LightningCLI, on 2 CPU processes.

Trainer (one 2-process job, several fits): streaming DiLoCo with the sparse exchange equals the same
algorithm run by hand on each rank's shard (tests/lightning/test_diloco_strategy.py's hand loop, which
tests/hooks/test_diloco_sparse.py checks against a dense reference of the algorithm); a resume from an epoch-end
checkpoint taken while an exchange is in flight is bit-identical to the uninterrupted run, error buffers
included, and the checkpoint (``weights_only=True``) holds each rank's own error buffers; with plain DiLoCo
every rank's replica is verified bitwise after every outer step; the loggers get the bytes each outer
exchange sent and received. Fabric: ``fabric.save``/``load`` resumes exactly. LightningCLI: the shipped
YAML trains and checkpoints every rank's error buffers.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DistributedSampler

from tests.dist_utils import REPO_ROOT, run_distributed
from tests.lightning.test_diloco_strategy import AdamRegressor, Recorder, by_hand, strategy
from tests.oracle import assert_same_tensors
from tests.strategy_helpers import BATCH_SIZE, dataset, fit, parameters_of, quiet

pytestmark = [pytest.mark.slow, pytest.mark.processes]

# fragment 0 is sent at steps 2, 6, 10, 14, fragment 1 at 4, 8, 12, 16, each applied one step later: at the
# end of epoch 0 (step 8) fragment 1's exchange is in flight, and both fragments' errors are non-zero.
STREAMING = {
    "period": 4,
    "fragments": 2,
    "overlap_steps": 1,
    "outer_lr": 0.8,
    "sparse": {"density": 0.1, "bits": 2, "chunk": 32},
}
PLAIN = {"period": 3, "sparse": {"density": 0.1, "bits": 4, "chunk": 32, "error_decay": 0.99}}


def errors_of(trainer: Any) -> list[torch.Tensor]:
    return [e.clone() for e in trainer.strategy.comm_hook_state.errors]


class VerifyAfterOuterSteps(Callback):
    """After every batch whose outer step was applied: every rank's parameters bitwise the same (the
    engine's replica check raises otherwise), and the anchors too."""

    def __init__(self) -> None:
        self.verified: list[int] = []
        self._syncs = 0

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        state = trainer.strategy.comm_hook_state
        if state.syncs == self._syncs:
            return
        self._syncs = state.syncs
        trainer.strategy.model.verify_replicas(what="after an outer step of sparse DiLoCo")
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [a.clone() for a in state.anchors])
        assert all(torch.equal(a, b) for a, b in zip(*gathered)), f"anchors differ after step {state.step}"
        self.verified.append(state.step)


def trainer_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    out: dict = {}
    trainer, model = fit(strategy(STREAMING), max_steps=-1, max_epochs=2, model_cls=AdamRegressor)
    out["streaming"] = parameters_of(model)
    out["streaming/errors"] = errors_of(trainer)
    out["streaming/by_hand"] = by_hand(rank, world_size, STREAMING, epochs=2)

    checkpoint = ModelCheckpoint(dirpath=directory, filename="sparse-{epoch}", save_on_train_epoch_end=True)
    fit(
        strategy(STREAMING), max_steps=-1, max_epochs=1, model_cls=AdamRegressor, enable_checkpointing=True,
        callbacks=[checkpoint],
    )  # fmt: skip
    path = os.path.join(directory, "sparse-epoch=0.ckpt")
    out["path"] = path
    trainer, model = fit(
        strategy(STREAMING), max_steps=-1, max_epochs=2, model_cls=AdamRegressor, ckpt_path=path
    )
    out["resumed"] = parameters_of(model)
    out["resumed/errors"] = errors_of(trainer)

    verifier, recorder = VerifyAfterOuterSteps(), Recorder()
    fit(
        strategy(PLAIN, comm_stats_every_n_steps=1),
        max_steps=-1,
        max_epochs=2,
        model_cls=AdamRegressor,
        callbacks=[verifier],
        logger=recorder,
    )
    out["verified"] = verifier.verified
    out["logged"] = recorder.records
    return out


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("sparse_diloco"))
    return run_distributed(trainer_job, 2, directory, init_process_group=False, timeout=300)


def test_trainer_equals_the_algorithm_by_hand(trainer_results):
    for out in trainer_results:
        assert_same_tensors(out["streaming"], out["streaming/by_hand"], "Trainer vs by hand", 0.0, 1e-6)
    first, second = (out["streaming/errors"] for out in trainer_results)
    assert any(e.abs().max() > 0 for e in first) and any(not torch.equal(a, b) for a, b in zip(first, second))


def test_trainer_resume_is_bit_identical_and_the_checkpoint_holds_every_ranks_errors(trainer_results):
    for out in trainer_results:
        assert_same_tensors(out["resumed"], out["streaming"], "resumed vs continuous", 0.0, 0.0)
        assert all(torch.equal(a, b) for a, b in zip(out["resumed/errors"], out["streaming/errors"]))
    entry = torch.load(trainer_results[0]["path"], weights_only=True)["lightning_ddpx"]
    assert entry["hook"] == "diloco" and entry["world_size"] == 2
    assert set(entry["shared"]["in_flight"]) == {1}  # fragment 1, sent at step 8
    errors = [part["errors"] for part in entry["per_rank"]]
    assert [e.shape for e in errors[0]] == [p.shape for p in AdamRegressor().parameters()]
    assert all(e.abs().max() > 0 for e in errors[0]) and any(not torch.equal(a, b) for a, b in zip(*errors))


def test_replicas_are_bit_identical_after_every_outer_step(trainer_results):
    for out in trainer_results:
        assert out["verified"] == [3, 6, 9, 12, 15]  # period 3, 16 steps


def test_loggers_get_the_bytes_each_outer_exchange_sent_and_received(trainer_results):
    from lightning_ddpx.hooks.diloco import DiLoCoOptions
    from lightning_ddpx.hooks.sparse_exchange import SparseCodec

    payload = SparseCodec(
        [p.numel() for p in AdamRegressor().parameters()], DiLoCoOptions(**PLAIN).sparse
    ).payload_bytes
    logged = [m for _, m in trainer_results[0]["logged"] if "ddpx/outer_sync_bytes" in m]
    assert [int(m["ddpx/outer_sync_bytes"]) for m in logged] == [payload] * 5
    assert [int(m["ddpx/outer_sync_bytes_received"]) for m in logged] == [payload] * 5  # the other rank's
    assert int(logged[-1]["ddpx/outer_bytes_received_total"]) == 5 * payload


# ------------------------------------------------------------------------------------------- Fabric
def fabric_run(data, path: str | None = None, save_at: int | None = None):
    from lightning.fabric import Fabric, seed_everything

    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy

    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy=DDPXStrategy(comm_hook="diloco", diloco=STREAMING, timeout=timedelta(seconds=60)),
    )
    fabric.launch()
    seed_everything(0, verbose=False)
    model = AdamRegressor()
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if path is not None and save_at is None:
        fabric.load(path, state)
    for step in range(state["step"], len(data)):
        x, y = data[step]
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if save_at is not None and step + 1 == save_at:
            fabric.save(path, {**state, "step": save_at})
    return model


def fabric_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    x, y = dataset().tensors
    shard = list(DistributedSampler(dataset(), num_replicas=world_size, rank=rank, shuffle=True, seed=0))
    data = [
        (x[shard[i : i + BATCH_SIZE]], y[shard[i : i + BATCH_SIZE]]) for i in range(0, len(shard), BATCH_SIZE)
    ]
    model = fabric_run(data)
    errors = [e.clone() for e in model._forward_module.comm_hook_state.errors]
    out = {"fabric": parameters_of(model.module), "by_hand": by_hand(rank, world_size, STREAMING, epochs=1)}
    path = os.path.join(directory, "fabric.ckpt")
    fabric_run(data, path=path, save_at=5)  # fragment 0 sent at 2 and its error kept, fragment 1 at 4
    resumed = fabric_run(data, path=path)
    out["resumed"] = parameters_of(resumed.module)
    out["errors_equal"] = all(
        torch.equal(a, b) for a, b in zip(errors, resumed._forward_module.comm_hook_state.errors)
    )
    dist.barrier()
    return out


def test_fabric_equals_the_algorithm_by_hand_and_resumes_exactly(tmp_path):
    for out in run_distributed(fabric_job, 2, str(tmp_path), init_process_group=False, timeout=180):
        assert_same_tensors(out["fabric"], out["by_hand"], "Fabric vs by hand", 0.0, 1e-6)
        assert_same_tensors(out["resumed"], out["fabric"], "resumed vs continuous", 0.0, 0.0)
        assert out["errors_equal"]


# --------------------------------------------------------------------------------------- LightningCLI
def test_yaml_config_trains_and_checkpoints_every_ranks_errors(tmp_path):
    from tests.lightning.test_strategy_cli import run_cli

    config = REPO_ROOT / "examples" / "configs" / "sparseloco.yaml"
    checkpoint = run_cli(["--config", str(config), "--trainer.strategy.diloco.period=3"], tmp_path)
    entry = torch.load(checkpoint, weights_only=True)["lightning_ddpx"]
    assert entry["hook"] == "diloco" and entry["world_size"] == 2
    assert (entry["shared"]["step"], entry["shared"]["syncs"]) == (6, 2)
    first, second = (part["errors"] for part in entry["per_rank"])
    assert any(e.abs().max() > 0 for e in first) and any(not torch.equal(a, b) for a, b in zip(first, second))
    saved = (tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "comm_hook: diloco" in saved and "density: 0.04" in saved and "error_decay: 0.999" in saved
