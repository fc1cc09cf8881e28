"""A fault-tolerant run in a real project's shape, for the tests: what users combine, not what our tests wrote.

    python tests/jobs/fault_project_job.py OUT_DIR

A small classifier (``BatchNorm1d`` included) on 384 generated samples, batch 8, trained by
``Trainer(devices=N, strategy=DDPXStrategy(fault_tolerance=...))`` with what a project has: validation every
epoch with a torchmetrics ``Accuracy`` and ``self.log("val_loss", ..., sync_dist=True)``, Adam with
``ReduceLROnPlateau(monitor="val_loss")`` and a ``StepLR``, ``ModelCheckpoint(monitor="val_loss", save_top_k=2,
save_last=True)``, ``EarlyStopping``, ``LearningRateMonitor``, a ``CSVLogger`` and a ``TensorBoardLogger``,
gradient clipping; ``PROJECT_ACCUMULATE`` sets ``accumulate_grad_batches``.

``PROJECT_KILLS`` lists kills, ``rank<R>:<point>:<epoch>`` separated by commas: the process that is rank R
of the membership then SIGKILLs itself, once over the run, at ``train`` (its 3rd training batch of that
epoch), ``validation`` (its 2nd validation batch), ``epoch_end`` (``on_train_epoch_end``) or ``save``
(inside the epoch's top-k checkpoint save). ``PROJECT_DEVICES`` (3), ``PROJECT_EPOCHS`` (4),
``PROJECT_REPLACEMENTS`` (1); ``PROJECT_FAIL``: ``manual`` (manual optimisation, which fault tolerance
refuses) or ``raise`` (every process raises a ValueError in epoch 1's second training batch); at an epoch's end the members wait until a replacement that is due has
registered, so that it is admitted at the next epoch's start.

What each training process writes to ``OUT_DIR``:
- ``<uid>.state``: after each optimizer step, ``global_step generation world_size piece=digest ...``, a digest of
  every piece of the state a checkpoint would hold (``dump_checkpoint()``: weights, optimizer, schedulers,
  loops, each callback's state), so that a test names the piece that differs;
- ``<uid>.seen``: ``train|val epoch world_size idx ...`` for every batch (the dataset yields sample indices);
- ``<uid>.val``: ``epoch val_loss lr`` at each validation's end (what the scheduler monitors).
The process the user started writes ``main.json`` after ``fit``: the global step, the checkpoint callback's
``best_model_path``, ``best_k_models`` and ``last_model_path``, and whether the best checkpoint loads.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_ddpx import DDPXStrategy
from lightning_ddpx.lightning import _compat as lightning_compat
from lightning_ddpx.lightning.fault_tolerance.state import state_digests

TRAIN_SAMPLES, VAL_SAMPLES, BATCH, FEATURES, CLASSES = (
    384,
    192,
    8,
    8,
    3,
)  # 384 and 192 divide by 2, 3, 4 ranks


class Indexed(Dataset):
    """Generated classification data that yields each sample's index, so coverage can be checked."""

    def __init__(self, samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, FEATURES, generator=g)
        self.y = (self.x[:, :3].sum(dim=1) * 1.3).round().clamp(-1, 1).long() + 1  # three classes

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, CLASSES)
        )
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.out = os.environ["PROJECT_OUT"]
        self.uid = os.environ.get("DDPX_FT_UID", "main")
        self.kills = [kill.split(":") for kill in os.environ.get("PROJECT_KILLS", "").split(",") if kill]
        self.fail = os.environ.get("PROJECT_FAIL", "")
        self.automatic_optimization = self.fail != "manual"

    # ---------------------------------------------------------------- kills, once each over the run
    def maybe_die(self, point: str, nth: int = 0) -> None:
        if self._trainer is None or self.uid == "main":
            return
        for index, (rank, at, epoch) in enumerate(self.kills):
            if (at, int(epoch), int(rank[4:])) != (point, self.current_epoch, self.global_rank) or nth:
                continue
            try:  # the marker makes it once: a replacement or a survivor that becomes rank R lives on
                os.close(os.open(os.path.join(self.out, f"kill-{index}.done"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            os.kill(os.getpid(), signal.SIGKILL)

    def _record(self, name: str, line: str) -> None:
        with open(os.path.join(self.out, f"{self.uid}.{name}"), "a") as log:
            log.write(line + "\n")

    # ---------------------------------------------------------------------------------- training
    def training_step(self, batch, batch_idx):
        self.maybe_die("train", nth=0 if batch_idx == 2 else 1)
        if self.fail == "raise" and self.current_epoch == 1 and batch_idx == 1:
            raise ValueError("the training code's own error, in every process (epoch 1, batch 1)")
        x, y, index = batch
        self._record("seen", f"train {self.current_epoch} {self.trainer.world_size} " + _indices(index))
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        fault = self.trainer.strategy._run.fault
        # the module's buffers (BatchNorm's running statistics) are per rank by design between forwards, as
        # under torch's DDP: the next forward broadcasts rank 0's
        checkpoint = lightning_compat.dump_checkpoint(self.trainer)
        digests = state_digests(checkpoint, (name for name, _ in self.named_parameters()))
        pieces = " ".join(
            f"{name.split('{')[0].replace(' ', '_')}={value}" for name, value in digests.items()
        )
        batches = self.trainer.fit_loop.epoch_loop.total_batch_idx
        self._record(
            "state",
            f"{self.trainer.global_step}:{batches} {fault.generation.number} {fault.world_size} {pieces}",
        )

    def on_train_epoch_end(self) -> None:
        self.maybe_die("epoch_end")

    def wait_for_a_replacement(self) -> None:
        """While a member is missing and a replacement is due, wait (up to 60 s) until it has registered, so
        that it is admitted at the next epoch's start however slowly it started: the tests then know where
        each heal happens. Called last at each epoch's end (by the checkpoint callback, which Lightning runs
        after every other ``on_train_epoch_end``)."""
        fault = self.trainer.strategy._run.fault
        kills = len([name for name in os.listdir(self.out) if name.startswith("kill-")])
        due = min(kills, int(os.environ.get("PROJECT_REPLACEMENTS", "1")))
        admitted = fault.generation.joiners_consumed - int(os.environ.get("PROJECT_DEVICES", "3"))
        deadline = time.monotonic() + 60
        while (
            admitted < due
            and fault.membership.joiners_seen() <= fault.generation.joiners_consumed
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)

    # -------------------------------------------------------------------------------- validation
    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self.maybe_die("validation", nth=0 if batch_idx == 1 else 1)
            x, y, index = batch
            self._record("seen", f"val {self.current_epoch} {self.trainer.world_size} " + _indices(index))
        x, y, _ = batch
        logits = self.net(x)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        metrics = self.trainer.callback_metrics
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self._record("val", f"{self.current_epoch} {float(metrics['val_loss']):.8f} {lr}")

    def on_fit_end(self) -> None:
        """What this member's ModelCheckpoint reports (equal on every member, and true of the files)."""
        callback = self.trainer.checkpoint_callback
        report = {
            "best_model_path": callback.best_model_path,
            "best_k_models": sorted(callback.best_k_models),
            "last_model_path": callback.last_model_path,
        }
        self._record("checkpoints", json.dumps(report))

    # --------------------------------------------------------------------------------- set-up
    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.9)
        return [optimizer], [
            {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch"},
            {"scheduler": step, "interval": "step"},
        ]

    def train_dataloader(self):
        return DataLoader(Indexed(TRAIN_SAMPLES, seed=1), batch_size=BATCH, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Indexed(VAL_SAMPLES, seed=2), batch_size=BATCH)


class KillingCheckpoint(ModelCheckpoint):
    """ModelCheckpoint, whose save is where a ``save`` kill happens (in the save of the epoch's top-k or
    last checkpoint, before the file is written); at the epoch's very end it waits for a replacement due."""

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        trainer.lightning_module.maybe_die("save")
        super()._save_checkpoint(trainer, filepath)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        pl_module.wait_for_a_replacement()


def _indices(index: torch.Tensor) -> str:
    return " ".join(str(int(i)) for i in index)


def main() -> None:
    out = sys.argv[1]
    os.environ["PROJECT_OUT"] = out
    options = {
        "replacements": int(os.environ.get("PROJECT_REPLACEMENTS", "1")),
        "heartbeat_timeout_s": 5.0,
        "collective_timeout_s": 20.0,
        "join_timeout_s": 120.0,
    }
    checkpoints = KillingCheckpoint(
        dirpath=os.path.join(out, "checkpoints"),
        monitor="val_loss",
        save_top_k=2,
        save_last=True,
        filename="{epoch}-{val_loss:.4f}",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("PROJECT_DEVICES", "3")),
        strategy=DDPXStrategy(fault_tolerance=options),
        max_epochs=int(os.environ.get("PROJECT_EPOCHS", "4")),
        accumulate_grad_batches=int(os.environ.get("PROJECT_ACCUMULATE", "1")),
        gradient_clip_val=1.0,
        logger=[CSVLogger(out, name="csv"), TensorBoardLogger(out, name="tb")],
        callbacks=[
            checkpoints,
            EarlyStopping(monitor="val_loss", patience=50),
            LearningRateMonitor(logging_interval="step"),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=4,
        num_sanity_val_steps=1,
    )
    model = Classifier()
    trainer.fit(model)
    best = checkpoints.best_model_path
    loads = bool(best) and os.path.isfile(best) and "state_dict" in torch.load(best, weights_only=False)
    with open(os.path.join(out, "main.json"), "w") as f:
        json.dump(
            {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "best_model_path": best,
                "best_loads": loads,
                "best_k_models": sorted(checkpoints.best_k_models),
                "last_model_path": checkpoints.last_model_path,
            },
            f,
        )


if __name__ == "__main__":
    main()
