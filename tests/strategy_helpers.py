"""Models and per-rank runners shared by the strategy tests (tests/lightning/test_strategy_*.py).

Each rank is a process started by :func:`tests.dist_utils.run_distributed` with ``init_process_group=False``:
it finds MASTER_ADDR/MASTER_PORT/RANK/LOCAL_RANK/WORLD_SIZE in its environment, so Lightning picks its
``LightningEnvironment``, sees that the processes already exist (``LOCAL_RANK`` is set) and launches
nothing; the strategy's ``setup_distributed`` creates the process group. Several ``Trainer.fit`` calls
in one process share that group, which keeps the suite fast.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpx import collectives_issued_on_call
from tests.dist_utils import quiet  # noqa: F401 - the rank functions of the strategy tests import it from here

NUM_SAMPLES = 64
BATCH_SIZE = 4  # per rank: 8 batches per rank and epoch on 2 ranks


def dataset() -> TensorDataset:
    """Fixed regression data; DistributedSampler gives each rank different samples, so gradients differ."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, 8, generator=generator)
    y = torch.randn(NUM_SAMPLES, 4, generator=generator)
    return TensorDataset(x, y)


class TinyRegressor(LightningModule):
    """An unmodified, ordinary LightningModule: 8 -> 16 -> 4 MLP, SGD with momentum, MSE."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=BATCH_SIZE, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=BATCH_SIZE * 4, shuffle=False)


class ManualTwoOptimizers(TinyRegressor):
    """Manual optimisation with two optimisers and toggle_optimizer, GAN style: each sub-net steps alone."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.head = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_net, opt_head = self.optimizers()
        for optimizer in (opt_net, opt_head):
            self.toggle_optimizer(optimizer)
            loss = nn.functional.mse_loss(self.head(self.net(x)), y)
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.net.parameters(), lr=self.lr),
            torch.optim.SGD(self.head.parameters(), lr=self.lr),
        ]


class ManualAccumulate(TinyRegressor):
    """Manual optimisation with one optimiser, stepping every 2 batches; sync only on the stepping batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizer = self.optimizers()
        step_now = batch_idx % 2 == 1
        with optimizer.toggle_model(sync_grad=step_now):
            self.manual_backward(nn.functional.mse_loss(self(x), y) / 2)
        if step_now:
            optimizer.step()
            optimizer.zero_grad()


class BranchUnusedOnRank1(TinyRegressor):
    """``extra`` takes part in the loss on rank 0 only: a parameter unused on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        if self.global_rank == 0:
            out = out + self.extra(out)
        return nn.functional.mse_loss(out, y)


@collectives_issued_on_call
def counting_allreduce_hook(state: dict, bucket: Any) -> torch.futures.Future:
    """Mean allreduce that counts its calls in ``state`` (a user-style callable hook with a plain state)."""
    state["buckets"] += 1
    state["syncs"] += int(bucket.is_last())
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future()


class CollectiveCounter(Callback):
    """Counts ``torch.distributed.all_reduce`` calls made during each training batch (forward, backward, step)."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self._calls = 0
        self._original: Callable | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._original = dist.all_reduce

        def counting(*args: Any, **kwargs: Any) -> Any:
            self._calls += 1
            return self._original(*args, **kwargs)

        dist.all_reduce = counting

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = self._calls

    def on_train_batch_end(self, *args: Any) -> None:
        self.per_batch.append(self._calls - self._start)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dist.all_reduce = self._original


def make_trainer(strategy: Any, max_steps: int, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=strategy,
        max_steps=max_steps,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    options.update(kwargs)
    return Trainer(**options)


def fit(
    strategy: Any,
    max_steps: int,
    model_cls: type[LightningModule] = TinyRegressor,
    seed: int = 0,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> tuple[Trainer, LightningModule]:
    """One ``Trainer.fit`` from a freshly seeded model; returns the trainer and the trained module."""
    seed_everything(seed, verbose=False)
    model = model_cls()
    trainer = make_trainer(strategy, max_steps, **trainer_kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}
