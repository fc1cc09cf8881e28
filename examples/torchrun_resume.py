"""Restart after a lost rank under torchrun: resume from the last checkpoint, PowerSGD state included.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 --max-restarts 1 examples/torchrun_resume.py --workdir /tmp/ddpx_restart

torchrun's agent keeps one TCP store for every attempt, and a killed attempt's keys stay in it; the strategy
creates each attempt's process group on that attempt's own keys (``lightning_ddpx/lightning/processes/restart_rendezvous.py``),
so a restart connects without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (pytorch/pytorch#135712;
docs/checkpointing.md).

torchrun starts 2 processes; Lightning sees torchrun's environment (``TorchElasticEnvironment``) and launches
nothing itself. Training uses ``DDPXStrategy`` with PowerSGD (compressing from step 2) and a
``ModelCheckpoint`` that writes a checkpoint and ``last.ckpt`` at the end of every epoch, through
``AtomicCheckpointIO`` so that a kill during a write cannot leave a torn ``last.ckpt``.

On the first attempt (``TORCHELASTIC_RESTART_COUNT=0``) rank 1 kills itself with SIGKILL in the middle of
epoch ``--kill-epoch``, as a crashed or preempted worker would. torchrun stops the other rank and starts both
again (``--max-restarts 1``); the new processes find ``last.ckpt`` and resume from it with
``fit(ckpt_path="last")``: model, optimizer, loops, and every rank's PowerSGD state (error feedback,
warm-start memory, iteration). Because the checkpoint is taken at an epoch boundary and the sampler's
shuffling depends only on the seed and the epoch, the resumed run ends with exactly the parameters of a run
that was never interrupted (``--kill-epoch -1``); tests/lightning/test_restart_torchrun.py checks this bit for bit.

Each process writes ``attempt<N>-rank<R>.json`` into ``--workdir`` (what it resumed from, and the PowerSGD
iteration it started at); rank 0 writes the final parameters to ``--workdir/final.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpx import DDPXStrategy
from lightning_ddpx.lightning.checkpoints.checkpoint_io import AtomicCheckpointIO

SEED = 7


class Regressor(LightningModule):
    """8 -> 32 -> 4 MLP on fixed random data, SGD with momentum: deterministic on CPU, no dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1234)
        data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 4, generator=generator))
        # shuffle=True: Lightning swaps in a DistributedSampler seeded by seed_everything, reshuffled per epoch
        return DataLoader(data, batch_size=4, shuffle=True)


class KillRank(Callback):
    """SIGKILL this process at one batch, as a crashed worker: no exception, no cleanup, no checkpoint."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            print(
                f"[rank {trainer.global_rank}] killing myself in epoch {self.epoch}, batch {batch_idx}",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)


class RecordStart(Callback):
    """Write where this attempt started: the resumed epoch, global step and PowerSGD iteration."""

    def __init__(self, path: str, info: dict[str, Any]) -> None:
        self.path, self.info = path, info

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state = trainer.strategy.comm_hook_state
        record = dict(
            self.info, epoch=trainer.current_epoch, global_step=trainer.global_step, powersgd_iter=state.iter
        )
        with open(self.path, "w") as file:
            json.dump(record, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", required=True, help="checkpoints, per-attempt records and final.pt go here"
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill-epoch", type=int, default=2, help="-1: never (the uninterrupted reference)")
    parser.add_argument("--kill-batch", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*log_every_n_steps.*")

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    checkpoint_dir = os.path.join(args.workdir, "checkpoints")
    os.makedirs(args.workdir, exist_ok=True)
    last = os.path.join(checkpoint_dir, "last.ckpt")
    ckpt_path = "last" if os.path.exists(last) else None

    callbacks: list[Callback] = [
        ModelCheckpoint(
            dirpath=checkpoint_dir,
            filename="{epoch}",
            save_last=True,
            save_top_k=-1,
            save_on_train_epoch_end=True,
        ),
        RecordStart(
            os.path.join(args.workdir, f"attempt{attempt}-rank{rank}.json"),
            {"attempt": attempt, "rank": rank, "resumed_from": last if ckpt_path else None},
        ),
    ]
    if attempt == 0 and rank == 1 and args.kill_epoch >= 0:
        callbacks.append(KillRank(args.kill_epoch, args.kill_batch))

    seed_everything(SEED, verbose=False)  # the same on every attempt: the same initial weights and data order
    model = Regressor()
    strategy = DDPXStrategy(
        comm_hook="powersgd",
        powersgd={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
        checkpoint_io=AtomicCheckpointIO(),
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=args.epochs,
        deterministic=True,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        final = {
            "parameters": {name: p.detach().clone() for name, p in model.named_parameters()},
            "global_step": trainer.global_step,
            "powersgd_iter": trainer.strategy.comm_hook_state.iter,
            "attempt": attempt,
        }
        torch.save(final, os.path.join(args.workdir, "final.pt"))
        print(f"[rank 0] attempt {attempt}: finished at global step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
