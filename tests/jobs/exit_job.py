"""One rank of a small 2-process Lightning job that ends the way users' jobs end, for tests/lightning/test_process_exit.py.

Run as ``python -m tests.jobs.exit_job MODE HOOK ROOT`` in each rank's process, with MASTER_ADDR, MASTER_PORT,
LOCAL_RANK, NODE_RANK and WORLD_SIZE set (so Lightning launches nothing; the test owns both processes and
sees both exit codes), or with ``MODE=spawn`` in a single process (``ddpx_spawn`` starts the ranks).

MODE: ``fit`` (2 epochs, ModelCheckpoint last.ckpt and a checkpoint at step 12 from a callback, then
``trainer.save_checkpoint`` after fit), ``straight`` (4 epochs), ``resume:<file>`` (4 epochs from a
checkpoint in ROOT), ``evaluate`` (validate, test and predict without fit), ``fabric`` (a Fabric loop with
save and load), ``spawn``, ``exception`` (every rank raises in training_step at step 3). The final
parameters of rank r are saved to ROOT/params-MODE-rank{r}.pt for exactness checks.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpx import DDPXStrategy

BATCHES_PER_EPOCH = 8  # per rank
STEP_OF_MID_FIT_CHECKPOINT = 8  # the last batch of the first epoch (mid-epoch: see test_process_exit.py)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BATCHES_PER_EPOCH * 4, 1, 8, 8, generator=generator)
    y = torch.randint(0, 10, (len(x),), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4)


class ConvNet(LightningModule):
    """A user's own small conv net with BatchNorm (buffers broadcast every step)."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.fail_at_step = fail_at_step
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 4 * 4, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise ValueError(f"exit_job: failing on purpose at step {self.global_step}")
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SaveAtStep(Callback):
    """``trainer.save_checkpoint`` during fit, at a step in the middle of an epoch."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def strategy(hook: str, **extra: Any) -> DDPXStrategy | str:
    """Several buckets (tiny caps), so stateful hooks keep memory per bucket; ``torch``: Lightning's "ddp"."""
    if hook == "torch":
        return "ddp"
    options: dict[str, Any] = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001, **extra}
    if hook in ("powersgd", "batched_powersgd"):
        options["powersgd"] = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3}
    if hook != "none":
        options["comm_hook"] = hook
    return DDPXStrategy(**options)


def trainer(hook: str, root: str, max_epochs: int, callbacks: list | None = None, **extra: Any) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=2, strategy=strategy(hook, **extra), max_epochs=max_epochs,
        default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks or [], enable_checkpointing=bool(callbacks),
    )  # fmt: skip


def save_parameters(module: nn.Module, root: str, mode: str, rank: int) -> None:
    state = {name: p.detach().clone() for name, p in module.state_dict().items()}
    torch.save(state, os.path.join(root, f"params-{mode.replace(':', '-')}-rank{rank}.pt"))


def run_fabric(hook: str, root: str) -> None:
    from lightning.fabric import Fabric

    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPX

    options: dict[str, Any] = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001, "comm_hook": hook}
    if hook in ("powersgd", "batched_powersgd"):
        options["powersgd"] = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3}
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricDDPX(**options))
    fabric.launch()
    model = ConvNet()
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(data())
    for x, y in loader:
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    path = os.path.join(root, "fabric.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.load(path, {"model": model, "optimizer": optimizer})
    save_parameters(model, root, "fabric", fabric.global_rank)


def main(mode: str, hook: str, root: str) -> None:
    warnings.filterwarnings("ignore")
    seed_everything(0, verbose=False)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if mode == "fabric":
        run_fabric(hook, root)
        return
    if mode == "spawn":
        trainer(hook, root, max_epochs=1, start_method="spawn").fit(ConvNet(), data())
        return
    if mode == "evaluate":
        run = trainer(hook, root, max_epochs=1)
        model = ConvNet()
        run.validate(model, data())
        run.test(model, data())
        run.predict(model, data())
        return
    model = ConvNet(fail_at_step=3 if mode == "exception" else None)
    if mode == "fit":
        callbacks = [
            ModelCheckpoint(dirpath=root, save_last=True),
            SaveAtStep(STEP_OF_MID_FIT_CHECKPOINT, os.path.join(root, "during-fit.ckpt")),
        ]
        run = trainer(hook, root, max_epochs=2, callbacks=callbacks)
        run.fit(model, data())
        run.save_checkpoint(os.path.join(root, "after-fit.ckpt"))
    elif mode.startswith("resume:"):
        run = trainer(hook, root, max_epochs=4)
        run.fit(model, data(), ckpt_path=os.path.join(root, mode.removeprefix("resume:")))
    elif mode in ("straight", "exception"):
        trainer(hook, root, max_epochs=4).fit(model, data())
    else:
        raise SystemExit(f"exit_job: unknown mode {mode!r}")
    save_parameters(model, root, mode, rank)


if __name__ == "__main__":
    main(*sys.argv[1:4])
