"""``DDPXStrategy(verify_replicas_every_n_steps=N)`` through the Trainer and Fabric: equal replicas pass, a
diverged rank fails on every rank naming the parameter, the ranks and the step -- before a checkpoint is
written -- and a backbone unfrozen mid-run (the fine-tuning schedule) is averaged, unlike Lightning's "ddp".
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint

from lightning_ddpx import DDPXStrategy
from lightning_ddpx.engine.agreement.replica_check import ReplicaMismatchError
from tests.dist_utils import run_distributed
from tests.strategy_helpers import TinyRegressor, fit, parameters_of, quiet


class FrozenFirstLayer(TinyRegressor):
    """``net.0`` frozen when wrapped; the optimizer holds the trainable parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.net[0]  # what BackboneFinetuning freezes and unfreezes (the same module)
        for p in self.net[0].parameters():
            p.requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)


class UnfreezeAtEpoch1(Callback):
    """What Lightning's ``BackboneFinetuning`` does: unfreeze, and hand the parameters to the optimizer."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == 1:
            params = list(pl_module.net[0].parameters())
            for p in params:
                p.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": params})


class DivergeRank1(Callback):
    """Nudge one element of rank 1's ``net.2.bias`` after global step ``at``: a silent divergence."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at and dist.get_rank() == 1:
            with torch.no_grad():
                pl_module.net[2].bias[0] += 1e-6


def fit_unfrozen(rank: int, world_size: int, strategy_name: str, callback: str = "own") -> dict[str, Any]:
    quiet()
    if strategy_name == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = DDPXStrategy(verify_replicas_every_n_steps=1, overlap_optimizer=strategy_name == "overlap")
    unfreeze = UnfreezeAtEpoch1() if callback == "own" else BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    _, model = fit(strategy, max_steps=12, model_cls=FrozenFirstLayer, callbacks=[unfreeze])
    return parameters_of(model)


def fit_diverging(rank: int, world_size: int, checkpoint_dir: str | None) -> str:
    quiet()
    every_n = 1000 if checkpoint_dir else 2
    callbacks: list[Any] = [DivergeRank1(at=3)]
    kwargs: dict[str, Any] = {}
    if checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=3, save_top_k=-1))
        kwargs["enable_checkpointing"] = True
    try:
        fit(DDPXStrategy(verify_replicas_every_n_steps=every_n), max_steps=8, callbacks=callbacks, **kwargs)
    except ReplicaMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", ["plain", "overlap"])
@pytest.mark.parametrize("callback", ["own", "BackboneFinetuning"])
@pytest.mark.processes
def test_a_backbone_unfrozen_mid_run_is_averaged(strategy_name: str, callback: str) -> None:
    ranks = run_distributed(fit_unfrozen, 2, strategy_name, callback, init_process_group=False, timeout=180)
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # verified at every step too
    seed_everything(0, verbose=False)  # as fit() does: the initial weights
    initial = FrozenFirstLayer().net[0].weight.detach()
    assert (ranks[0]["net.0.weight"] - initial).abs().max() > 1e-4  # it trained after unfreezing


@pytest.mark.slow
@pytest.mark.processes
def test_lightning_ddp_lets_the_unfrozen_backbone_diverge() -> None:
    """The bar: Lightning's "ddp" (torch's DDP) never averages the unfrozen layer; if this starts failing, the
    comparison in docs/engine.md is stale."""
    ranks = run_distributed(fit_unfrozen, 2, "ddp", init_process_group=False, timeout=180)
    assert not torch.equal(ranks[0]["net.0.weight"], ranks[1]["net.0.weight"])
    assert torch.equal(ranks[0]["net.2.weight"], ranks[1]["net.2.weight"])


@pytest.mark.slow
@pytest.mark.processes
def test_divergence_fails_on_every_rank_at_the_next_verification() -> None:
    messages = run_distributed(fit_diverging, 2, None, init_process_group=False, timeout=180)
    for message in messages:
        assert "every 2 optimizer steps" in message and "at step 4" in message, message
        assert "parameter 'net.2.bias'" in message and "ranks [1]" in message, message


@pytest.mark.slow
@pytest.mark.processes
def test_a_diverged_run_is_not_checkpointed(tmp_path: os.PathLike) -> None:
    messages = run_distributed(fit_diverging, 2, str(tmp_path), init_process_group=False, timeout=180)
    for message in messages:
        assert "before saving a checkpoint" in message and "parameter 'net.2.bias'" in message, message
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.processes
def test_fabric_verifies_every_n_steps_and_before_saving(tmp_path: os.PathLike) -> None:
    outcomes = run_distributed(fabric_diverging, 2, str(tmp_path), init_process_group=False, timeout=180)
    for out in outcomes:
        assert "every 2 optimizer steps" in out["step"] and "at step 4" in out["step"], out
        assert "parameter '0.weight'" in out["step"] and "ranks [1]" in out["step"], out
        assert "before saving a checkpoint" in out["save"], out
    assert os.listdir(tmp_path) == []


def test_the_option_is_checked_when_the_strategy_is_built() -> None:
    refused = ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("10", TypeError))
    for bad, error in refused:
        with pytest.raises(error, match="verify_replicas_every_n_steps must be (an integer )?>= 1 or None"):
            DDPXStrategy(verify_replicas_every_n_steps=bad)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="verify_replicas_every_n_steps cannot be combined with post-local SGD"
    ):
        DDPXStrategy(verify_replicas_every_n_steps=10, comm_hook="post_local_sgd", model_averaging_period=2)
    with pytest.raises(ValueError, match="verify_replicas_every_n_steps cannot be combined with DiLoCo"):
        DDPXStrategy(verify_replicas_every_n_steps=10, comm_hook="diloco")


def fabric_diverging(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    from datetime import timedelta

    from lightning.fabric import Fabric

    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPXStrategy

    quiet()
    strategy = FabricDDPXStrategy(timeout=timedelta(seconds=60), verify_replicas_every_n_steps=2)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    out: dict[str, Any] = {}
    for step in range(4):
        if step == 3 and rank == 1:
            with torch.no_grad():
                model.module[0].weight[0, 0] += 1e-6
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(4, 8) * (rank + 1)).pow(2).mean())
        try:
            optimizer.step()
        except ReplicaMismatchError as error:
            out["step"] = str(error)
    try:
        fabric.save(os.path.join(directory, "diverged.ckpt"), {"model": model})
    except ReplicaMismatchError as error:
        out["save"] = str(error)
    return out
