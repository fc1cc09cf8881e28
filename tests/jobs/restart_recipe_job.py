"""The standard restart recipe, as a new user writes it (issue 51): torchrun restarts every process after a
lost rank, and the Trainer resumes from ``last.ckpt``.

    python -m torch.distributed.run --nproc_per_node=2 --max-restarts=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:0 tests/jobs/restart_recipe_job.py --workdir DIR --strategy ddpx

No ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``: every attempt's processes share torchrun's TCP store, as by
default. On the first attempt (``TORCHELASTIC_RESTART_COUNT=0``) rank 1 SIGKILLs itself in epoch
``--kill-epoch`` (``-1``: never, the uninterrupted reference). Rank 0 writes the final parameters to
``DIR/final-attempt<N>.pt``. ``RECIPE_DUMP_AFTER_S``: every process dumps its threads' stacks into
``DIR/stacks-attempt<N>-rank<R>.txt`` after that many seconds, and again as often, for a hang.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1234)
        data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randn(32, 2, generator=generator))
        return DataLoader(data, batch_size=4, shuffle=True)


class KillRank(Callback):
    """SIGKILL this process at the second batch of ``epoch``: no exception, no cleanup."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--strategy", default="ddpx", help="ddpx, or torch's ddp for comparison")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--kill-epoch", type=int, default=3)
    args = parser.parse_args()
    for message in (".*does not have many workers.*", ".*log_every_n_steps.*", ".*GPU available.*"):
        warnings.filterwarnings("ignore", message=message)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    dump_after = float(os.environ.get("RECIPE_DUMP_AFTER_S", "0"))
    if dump_after > 0:
        stacks = open(os.path.join(args.workdir, f"stacks-attempt{attempt}-rank{rank}.txt"), "w")  # noqa: SIM115
        faulthandler.dump_traceback_later(dump_after, repeat=True, file=stacks)
    if args.strategy == "ddpx":
        import lightning_ddpx  # noqa: F401 - registers "ddpx"

    last = os.path.join(args.workdir, "checkpoints", "last.ckpt")
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=os.path.join(args.workdir, "checkpoints"), save_last=True, every_n_epochs=1)
    ]
    if attempt == 0 and rank == 1 and args.kill_epoch >= 0:
        callbacks.append(KillRank(args.kill_epoch))
    seed_everything(7, verbose=False)
    model = Regressor()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_epochs=args.epochs,
        deterministic=True,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path=last if os.path.exists(last) else None)
    if trainer.is_global_zero:
        final = {name: p.detach().clone() for name, p in model.named_parameters()}
        torch.save(
            {"parameters": final, "global_step": trainer.global_step},
            os.path.join(args.workdir, f"final-attempt{attempt}.pt"),
        )


if __name__ == "__main__":
    main()
