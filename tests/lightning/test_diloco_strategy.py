"""DiLoCo and streaming DiLoCo through the Trainer strategy, Fabric and LightningCLI, on 2 CPU processes.

Trainer (one 2-process job, several fits), with AdamW as the inner optimizer: the strategy equals the same
algorithm run by hand on each rank's shard (the hand loop is the one tests/hooks/test_diloco_oracle.py checks
against the papers), also with gradient accumulation (H counts optimizer steps); a resume from an
epoch-end checkpoint taken while a fragment's exchange is in flight is bit-identical to the uninterrupted
run, and the checkpoint (loaded with ``weights_only=True``) holds the step, anchors, outer momentum and the
exchange in flight; the loggers get the bytes of each outer sync; with uneven inputs every rank takes the
same number of inner steps and the anchors agree. Fabric: the same against the hand loop, and a
``fabric.save``/``load`` resume. LightningCLI: the shipped YAML trains and checkpoints the outer state.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.dist_utils import REPO_ROOT, run_distributed
from tests.oracle import assert_same_tensors
from tests.strategy_helpers import BATCH_SIZE, TinyRegressor, dataset, fit, parameters_of, quiet

pytestmark = [pytest.mark.slow, pytest.mark.processes]

EPOCH_STEPS = 8  # 64 samples / 2 ranks / batch 4
# fragment 0 is sent at steps 2, 6, 10, 14 and applied one step later; fragment 1 at 4, 8, 12, 16: at the
# end of epoch 0 (step 8) fragment 1's exchange is in flight.
STREAMING = {"period": 4, "fragments": 2, "overlap_steps": 1, "outer_lr": 0.8, "precision": "bf16"}
PLAIN = {"period": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
# the same schedule with two steps of overlap and 4-bit exchanges: at step 8 fragment 1's exchange is in flight
QUANTIZED = {**STREAMING, "overlap_steps": 2, "precision": "int4"}


class AdamRegressor(TinyRegressor):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)


class Recorder(Logger):
    """Keeps every metric logged (rank 0 only writes, as Lightning's loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def strategy(options: dict, **kwargs: Any):
    from lightning_ddpx import DDPXStrategy

    return DDPXStrategy(comm_hook="diloco", diloco=options, **kwargs)


def by_hand(rank: int, world_size: int, options: dict, epochs: int, accumulate: int = 1) -> dict:
    """The Trainer's run, written as a plain loop: each rank's shard as Lightning's DistributedSampler
    draws it (shuffled with seed 0, a new order each epoch)."""
    from lightning.pytorch import seed_everything

    from lightning_ddpx.lightning.settings.config import DDPXConfig

    seed_everything(0, verbose=False)
    model = AdamRegressor()
    config = DDPXConfig(comm_hook="diloco", diloco=options)
    module = config.wrap(model)
    state = config.register_hook(module)
    optimizer = model.configure_optimizers()
    x, y = dataset().tensors
    sampler = DistributedSampler(dataset(), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        shard = list(sampler)
        for start in range(0, len(shard), BATCH_SIZE * accumulate):
            for part in range(accumulate):
                index = shard[start + part * BATCH_SIZE : start + (part + 1) * BATCH_SIZE]
                (nn.functional.mse_loss(module(x[index]), y[index]) / accumulate).backward()
            optimizer.step()
            optimizer.zero_grad()
            state.averager.average_parameters(optimizer.param_groups)
    state.finish()
    return parameters_of(model)


class UnevenRegressor(AdamRegressor):
    """Rank 0 has 10 batches per epoch, rank 1 has 6 (no DistributedSampler)."""

    def train_dataloader(self) -> DataLoader:
        x, y = dataset().tensors
        count = 40 if self.global_rank == 0 else 24
        return DataLoader(TensorDataset(x[:count], y[:count]), batch_size=BATCH_SIZE)


def trainer_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    out: dict = {}
    trainer, model = fit(strategy(STREAMING), max_steps=-1, max_epochs=2, model_cls=AdamRegressor)
    out["streaming"] = parameters_of(model)
    state = trainer.strategy.comm_hook_state
    out["streaming/counters"] = (state.step, state.syncs)
    out["streaming/by_hand"] = by_hand(rank, world_size, STREAMING, epochs=2)

    trainer, model = fit(
        strategy(PLAIN), max_steps=-1, max_epochs=2, model_cls=AdamRegressor, accumulate_grad_batches=2
    )
    out["accumulate"] = parameters_of(model)
    out["accumulate/step"] = trainer.strategy.comm_hook_state.step
    out["accumulate/by_hand"] = by_hand(rank, world_size, PLAIN, epochs=2, accumulate=2)

    checkpoint = ModelCheckpoint(dirpath=directory, filename="diloco-{epoch}", save_on_train_epoch_end=True)
    fit(
        strategy(STREAMING),
        max_steps=-1,
        max_epochs=1,
        model_cls=AdamRegressor,
        enable_checkpointing=True,
        callbacks=[checkpoint],
    )
    path = os.path.join(directory, "diloco-epoch=0.ckpt")
    out["path"] = path
    trainer, model = fit(
        strategy(STREAMING), max_steps=-1, max_epochs=2, model_cls=AdamRegressor, ckpt_path=path
    )
    out["resumed"] = parameters_of(model)
    state = trainer.strategy.comm_hook_state
    out["resumed/counters"] = (state.step, state.syncs)

    trainer, model = fit(strategy(QUANTIZED), max_steps=-1, max_epochs=2, model_cls=AdamRegressor)
    out["int4"] = parameters_of(model)
    out["int4/by_hand"] = by_hand(rank, world_size, QUANTIZED, epochs=2)
    checkpoint = ModelCheckpoint(dirpath=directory, filename="int4-{epoch}", save_on_train_epoch_end=True)
    fit(
        strategy(QUANTIZED), max_steps=-1, max_epochs=1, model_cls=AdamRegressor, enable_checkpointing=True,
        callbacks=[checkpoint],
    )  # fmt: skip
    path = os.path.join(directory, "int4-epoch=0.ckpt")
    out["int4/path"] = path
    trainer, model = fit(
        strategy(QUANTIZED), max_steps=-1, max_epochs=2, model_cls=AdamRegressor, ckpt_path=path
    )
    out["int4/resumed"] = parameters_of(model)

    recorder = Recorder()
    fit(
        strategy(STREAMING, comm_stats_every_n_steps=1),
        max_steps=-1,
        max_epochs=1,
        model_cls=AdamRegressor,
        logger=recorder,
    )
    out["logged"] = recorder.records

    trainer, model = fit(
        strategy(PLAIN), max_steps=-1, max_epochs=2, model_cls=UnevenRegressor, use_distributed_sampler=False
    )
    state = trainer.strategy.comm_hook_state
    out["uneven/step"] = state.step
    out["uneven/anchors"] = [a.clone() for a in state.anchors]
    return out


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("diloco"))
    return run_distributed(trainer_job, 2, directory, init_process_group=False, timeout=300)


def test_trainer_equals_the_algorithm_by_hand(trainer_results):
    steps = 2 * EPOCH_STEPS
    for out in trainer_results:
        assert_same_tensors(out["streaming"], out["streaming/by_hand"], "Trainer vs by hand", 0.0, 1e-6)
        assert out["streaming/counters"] == (steps, 7)  # applied at 3, 5, 7, 9, 11, 13, 15
    gap = max((a - b).abs().max() for a, b in zip(*(o["streaming"].values() for o in trainer_results)))
    assert gap > 1e-5  # step 16 is after a sync of fragment 1's send only: the replicas differ


def test_gradient_accumulation_counts_optimizer_steps(trainer_results):
    for out in trainer_results:
        assert out["accumulate/step"] == EPOCH_STEPS  # 2 epochs of 4 optimizer steps
        assert_same_tensors(
            out["accumulate"], out["accumulate/by_hand"], "accumulation vs by hand", 0.0, 1e-6
        )


def test_trainer_resume_is_bit_identical_and_checkpoint_holds_the_outer_state(trainer_results):
    for out in trainer_results:
        assert_same_tensors(out["resumed"], out["streaming"], "resumed vs continuous", 0.0, 0.0)
        assert out["resumed/counters"] == out["streaming/counters"]
    checkpoint = torch.load(trainer_results[0]["path"], weights_only=True)
    entry = checkpoint["lightning_ddpx"]
    assert entry["hook"] == "diloco"
    shared = entry["shared"]
    assert shared["step"] == EPOCH_STEPS and shared["syncs"] == 3
    assert set(shared["in_flight"]) == {1} and shared["in_flight"][1]["apply_at"] == EPOCH_STEPS + 1
    assert shared["in_flight"][1]["mean_delta"].dtype == torch.bfloat16
    assert len(shared["anchors"]) == 4 and shared["outer_optimizer"]["state"]  # outer momentum buffers
    replicas = checkpoint["lightning_ddpx_replicas"]  # rank 1's own weights and AdamW moments
    assert replicas[0] is None and set(replicas[1]) == {"state_dict", "optimizer_states"}


def test_quantized_exchanges_train_as_by_hand_and_resume_bit_identically(trainer_results):
    for out in trainer_results:
        assert_same_tensors(out["int4"], out["int4/by_hand"], "int4: Trainer vs by hand", 0.0, 1e-6)
        assert_same_tensors(out["int4/resumed"], out["int4"], "int4: resumed vs continuous", 0.0, 0.0)
    shared = torch.load(trainer_results[0]["int4/path"], weights_only=True)["lightning_ddpx"]["shared"]
    assert set(shared["in_flight"]) == {1} and shared["in_flight"][1]["apply_at"] == EPOCH_STEPS + 2
    assert (
        shared["in_flight"][1]["mean_delta"].dtype == torch.float32
    )  # decoded when the checkpoint is written


def test_loggers_get_the_bytes_of_each_outer_sync(trainer_results):
    model = TinyRegressor()
    sizes = [p.numel() for p in model.parameters()]  # 128, 16, 64, 4: fragment 0 = first weight
    logged = [(step, m) for step, m in trainer_results[0]["logged"] if "ddpx/outer_sync_bytes" in m]
    assert [int(m["ddpx/outer_sync_fragment"]) for _, m in logged] == [0, 1, 0, 1]
    assert [step for step, _ in logged] == [1, 3, 5, 7]  # trainer.global_step: before this step counted
    expected = [sizes[0] * 2, sum(sizes[1:]) * 2] * 2  # bf16
    assert [int(m["ddpx/outer_sync_bytes"]) for _, m in logged] == expected
    assert int(logged[-1][1]["ddpx/outer_bytes_total"]) == sum(expected)
    per_step = [m for _, m in trainer_results[0]["logged"] if "ddpx/bytes_sent" in m]
    assert per_step and all(m["ddpx/bytes_sent"] == 0 for m in per_step)  # inner steps send nothing


def test_uneven_inputs_keep_the_schedule_in_lockstep(trainer_results):
    assert [out["uneven/step"] for out in trainer_results] == [20, 20]  # 2 epochs of rank 0's 10 batches
    for a, b in zip(*(out["uneven/anchors"] for out in trainer_results)):
        assert torch.equal(a, b)


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
    sampler = DistributedSampler(dataset(), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    shard = list(sampler)
    data = [
        (x[shard[i : i + BATCH_SIZE]], y[shard[i : i + BATCH_SIZE]]) for i in range(0, len(shard), BATCH_SIZE)
    ]
    model = fabric_run(data)
    state = model._forward_module.comm_hook_state
    out = {"fabric": parameters_of(model.module), "counters": (state.step, state.syncs)}
    out["by_hand"] = by_hand(rank, world_size, STREAMING, epochs=1)
    path = os.path.join(directory, "fabric.ckpt")
    fabric_run(data, path=path, save_at=4)  # fragment 1 sent at step 4, in flight
    out["resumed"] = parameters_of(fabric_run(data, path=path).module)
    dist.barrier()
    return out


def test_fabric_equals_the_algorithm_by_hand_and_resumes_exactly(tmp_path):
    for out in run_distributed(fabric_job, 2, str(tmp_path), init_process_group=False, timeout=180):
        assert out["counters"] == (EPOCH_STEPS, 3)
        assert_same_tensors(out["fabric"], out["by_hand"], "Fabric vs by hand", 0.0, 1e-6)
        assert_same_tensors(out["resumed"], out["fabric"], "resumed vs continuous", 0.0, 0.0)


# --------------------------------------------------------------------------------------- LightningCLI
def test_yaml_config_trains_and_checkpoints_the_outer_state(tmp_path):
    from tests.lightning.test_strategy_cli import run_cli

    config = REPO_ROOT / "examples" / "configs" / "diloco.yaml"
    checkpoint = run_cli(["--config", str(config), "--trainer.strategy.diloco.period=4"], tmp_path)
    entry = torch.load(checkpoint, weights_only=True)["lightning_ddpx"]
    assert entry["hook"] == "diloco" and entry["world_size"] == 2
    # max_steps=6, overlap 1: fragment 0 sent at 2 and 6, fragment 1 at 4; applied at 3 and 5
    shared = entry["shared"]
    assert (shared["step"], shared["syncs"], set(shared["in_flight"])) == (6, 2, {0})
    saved = (tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "comm_hook: diloco" in saved and "period: 4" in saved and "precision: int4" in saved
