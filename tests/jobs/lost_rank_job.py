"""A user's ``train.py`` in which one rank is SIGKILLed mid-training, for tests/lightning/test_lost_rank.py.

Run as ``python -m tests.jobs.lost_rank_job VICTIM PHASE [API]`` in one process, as a user runs a script:
Lightning's ``popen`` launcher (``strategy="ddpx"``) starts rank 1, and no fault tolerance is on. At
optimizer step ``KILL_AT_STEP`` (past the bucket rebuild), rank VICTIM kills itself with SIGKILL in PHASE:
``forward``, ``backward`` (in a gradient hook, while the reduction runs) or ``step`` (inside the optimizer's
step, between two iterations' collectives). API is ``trainer`` (the default) or ``fabric``. Each process
prints ``pid <rank> <pid>`` once its process group exists, for the test's leftover check; the victim prints
``killing <rank> <time>`` (its wall time) just before the kill.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ddpx  # noqa: F401 - registers strategy="ddpx", as a user's script does

KILL_AT_STEP = 3
PHASES = ("forward", "backward", "step")


def say(line: str) -> None:
    os.write(2, f"{line}\n".encode())  # one write: the two processes share the output


def _die(rank: int) -> None:
    say(f"killing {rank} {time.time():.3f}")
    os.kill(os.getpid(), signal.SIGKILL)


class Dying:
    """Where and when this process kills itself: ``at(phase)`` is called in each phase of each step."""

    def __init__(self, victim: int, phase: str) -> None:
        self.victim, self.phase, self.step, self.rank = victim, phase, 0, -1

    def at(self, phase: str) -> None:
        if self.rank == self.victim and phase == self.phase and self.step == KILL_AT_STEP:
            _die(self.rank)


def net(dying: Dying) -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model[0].weight.register_hook(lambda grad: dying.at("backward"))  # the last gradient: buckets in flight
    return model


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * 64, 16, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :4].sum(-1, keepdim=True).expand(-1, 4)), batch_size=4)


class DyingSGD(torch.optim.SGD):
    def __init__(self, params: Any, dying: Dying) -> None:
        super().__init__(params, lr=0.01)
        self.dying = dying

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)  # the Trainer's closure runs forward and backward in here
        self.dying.at("step")
        self.dying.step += 1
        return loss


def run_trainer(dying: Dying) -> None:
    from lightning.pytorch import LightningModule, Trainer

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(dying)

        def on_train_start(self) -> None:
            dying.rank = self.global_rank
            say(f"pid {dying.rank} {os.getpid()}")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            dying.at("forward")
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return DyingSGD(self.parameters(), dying)

    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddpx", max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Module(), data())


def run_fabric(dying: Dying) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddpx")
    fabric.launch()
    dying.rank = fabric.global_rank
    say(f"pid {dying.rank} {os.getpid()}")
    model = net(dying)
    model, optimizer = fabric.setup(model, DyingSGD(model.parameters(), dying))
    for x, y in fabric.setup_dataloaders(data()):
        dying.at("forward")
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def main(victim: str, phase: str, api: str = "trainer") -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if phase not in PHASES:
        raise SystemExit(f"lost_rank_job: PHASE must be one of {PHASES}, got {phase!r}")
    dying = Dying(int(victim), phase)
    (run_fabric if api == "fabric" else run_trainer)(dying)


if __name__ == "__main__":
    main(*sys.argv[1:4])
