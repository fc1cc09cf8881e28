"""Uneven inputs through the strategies: ranks with 10 and 7 batches (and 10/7/0 on 3 ranks) per epoch.

Every scenario must end without a hang (hard timeouts), with the same ``global_step`` and identical
parameters on every rank, and equal (1e-5) to a one-process oracle of the semantics: at step k the gradient
is the sum of the losses of the ranks that still have a batch k, divided by the world size, and SGD with
momentum steps every rank. Training logs with ``sync_dist=True`` every step, and validation with
``sync_dist=True`` runs at each epoch end, so Lightning's own collectives must stay matched.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.dist_utils import run_distributed
from tests.strategy_helpers import TinyRegressor, make_trainer, parameters_of, quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

COUNTS = {2: [10, 7], 3: [10, 7, 0]}
EPOCHS = 2
BATCH = 4


def rank_batches(rank: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(count * BATCH, 8, generator=generator), torch.randn(
        count * BATCH, 4, generator=generator
    )


class _Stream(IterableDataset):
    """An unsized stream of this rank's batches (Lightning fetches one ahead to find its end)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(0, len(self.x), BATCH):
            yield self.x[i : i + BATCH], self.y[i : i + BATCH]


class UnevenRegressor(TinyRegressor):
    def __init__(self, counts: list[int], iterable: bool = False) -> None:
        super().__init__()
        self.counts, self.iterable = counts, iterable

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        x, y = rank_batches(self.global_rank, self.counts[self.global_rank])
        if self.iterable:
            return DataLoader(_Stream(x, y), batch_size=None)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class UnevenManual(UnevenRegressor):
    """The same training in manual optimisation: manual_backward of a replayed batch counts zero too."""

    def __init__(self, counts: list[int], iterable: bool = False) -> None:
        super().__init__(counts, iterable)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        self.manual_backward(loss)
        optimizer.step()


def oracle(counts: list[int], epochs: int, accumulate: int = 1) -> dict[str, torch.Tensor]:
    seed_everything(0, verbose=False)
    model = TinyRegressor()
    optimizer = model.configure_optimizers()
    data = [rank_batches(r, n) for r, n in enumerate(counts)]
    for _ in range(epochs):
        for first in range(0, max(counts), accumulate):
            optimizer.zero_grad()
            for k in range(first, min(first + accumulate, max(counts))):
                losses = [
                    nn.functional.mse_loss(
                        model(x[k * BATCH : (k + 1) * BATCH]), y[k * BATCH : (k + 1) * BATCH]
                    )
                    for (x, y), n in zip(data, counts)
                    if k < n
                ]
                (sum(losses) / len(counts) / accumulate).backward()
            optimizer.step()
    return parameters_of(model)


def _fit(
    world_size: int, iterable: bool = False, manual: bool = False, **kwargs: Any
) -> tuple[Any, UnevenRegressor]:
    from lightning_ddpx import DDPXStrategy

    seed_everything(0, verbose=False)
    model = (UnevenManual if manual else UnevenRegressor)(COUNTS[world_size], iterable)
    strategy = DDPXStrategy(uneven_inputs=kwargs.pop("uneven_inputs", "join"), bucket_cap_mb=0.0005)
    options = dict(max_epochs=EPOCHS, max_steps=-1, devices=world_size, use_distributed_sampler=False)
    options.update(limit_val_batches=2, num_sanity_val_steps=0)
    options.update(kwargs)
    ckpt_path = options.pop("ckpt_path", None)
    trainer = make_trainer(strategy, **options)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def trainer_job(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    quiet()
    from lightning_ddpx.lightning.features.uneven import UnevenInputsError

    out: dict[str, Any] = {}
    for iterable in (False, True):
        trainer, model = _fit(world_size, iterable)
        out[f"iterable={iterable}"] = (trainer.global_step, parameters_of(model))
    trainer, model = _fit(world_size, manual=True)
    out["manual"] = (trainer.global_step, parameters_of(model))
    trainer, model = _fit(world_size, accumulate_grad_batches=2)  # replays inside no_sync windows too
    out["accumulate"] = (trainer.global_step, parameters_of(model))
    try:
        _fit(world_size, uneven_inputs="error")
        out["error"] = "no error"
    except UnevenInputsError as error:
        out["error"] = str(error)
    # a checkpoint in the uneven part of epoch 0 (step 8: rank 1 is replaying), then resume to the end
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_train_steps=8, save_top_k=-1, filename="{step}")
    _fit(world_size, max_epochs=1, callbacks=[checkpoint], enable_checkpointing=True)
    dist.barrier()
    trainer, model = _fit(world_size, ckpt_path=os.path.join(directory, "step=8.ckpt"))
    out["resumed"] = (trainer.global_step, parameters_of(model))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2_ranks_10_7", "3_ranks_10_7_0"])
def trainer_results(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    world_size = request.param
    directory = str(tmp_path_factory.mktemp(f"uneven{world_size}"))
    return world_size, run_distributed(
        trainer_job, world_size, directory, init_process_group=False, timeout=240, pg_timeout=30
    )


@pytest.mark.parametrize(
    "variant",
    ["iterable=False", "iterable=True", "manual"],
    ids=["sized_loader", "iterable_dataset", "manual_opt"],
)
@pytest.mark.processes
def test_trainer_uneven_epochs_end_together_and_match_the_oracle(trainer_results, variant) -> None:
    world_size, results = trainer_results
    expected = oracle(COUNTS[world_size], EPOCHS)
    for rank, result in enumerate(results):
        steps, params = result[variant]
        assert steps == EPOCHS * max(COUNTS[world_size]), f"rank {rank} took {steps} steps"
        for name, value in params.items():
            torch.testing.assert_close(value, results[0][variant][1][name], rtol=0, atol=0)
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


@pytest.mark.processes
def test_trainer_error_mode_names_every_rank_and_its_batch_count(trainer_results) -> None:
    world_size, results = trainer_results
    counts = ", ".join(f"rank {r}: {n}" for r, n in enumerate(COUNTS[world_size]))
    for result in results:
        assert "uneven_inputs='error'" in result["error"] and counts in result["error"], result["error"]


@pytest.mark.processes
def test_trainer_resumes_from_a_checkpoint_taken_in_the_uneven_part_of_an_epoch(trainer_results) -> None:
    world_size, results = trainer_results
    for rank, result in enumerate(results):
        steps, params = result["resumed"]
        assert steps == EPOCHS * max(COUNTS[world_size])
        for name, value in params.items():
            torch.testing.assert_close(
                value, results[0]["resumed"][1][name], rtol=0, atol=0, msg=f"rank {rank}"
            )


# --------------------------------------------------------------------------------------------- Fabric
def fabric_job(rank: int, world_size: int, mode: str) -> Any:
    quiet()
    from lightning.fabric import Fabric

    from lightning_ddpx.lightning.features.uneven import UnevenInputsError
    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=DDPXStrategy(uneven_inputs=mode))
    fabric.launch()
    seed_everything(0, verbose=False)
    module = TinyRegressor()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    x, y = rank_batches(rank, COUNTS[world_size][rank])
    steps = replays = 0
    try:  # "error" raises when the loop starts if the loaders have lengths, else at the first short next()
        loader = fabric.setup_dataloaders(
            DataLoader(TensorDataset(x, y), batch_size=BATCH), use_distributed_sampler=False
        )
        for _ in range(EPOCHS):
            for xb, yb in loader:
                optimizer.zero_grad()
                fabric.backward(nn.functional.mse_loss(model(xb), yb))
                optimizer.step()
                steps += 1
                replays += int(fabric.strategy.replaying)
    except UnevenInputsError as error:
        return str(error)
    evaluated = None
    if rank == 0:  # evaluation on one rank, gradients off: the plain loader, no collective to wait for
        with torch.no_grad():
            evaluated = sum(1 for _ in loader)
    return steps, replays, parameters_of(module), evaluated


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.processes
def test_fabric_uneven_loop_ends_together_and_matches_the_oracle(world_size: int) -> None:
    results = run_distributed(fabric_job, world_size, "join", init_process_group=False, timeout=120)
    expected = oracle(COUNTS[world_size], EPOCHS)
    longest = max(COUNTS[world_size])
    assert results[0][3] == COUNTS[world_size][0]
    for rank, (steps, replays, params, _) in enumerate(results):
        assert steps == EPOCHS * longest
        assert replays == EPOCHS * (longest - COUNTS[world_size][rank])
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


@pytest.mark.processes
def test_fabric_error_mode_names_the_batch_counts() -> None:
    results = run_distributed(fabric_job, 2, "error", init_process_group=False, timeout=120)
    assert all("rank 0: 10, rank 1: 7" in message for message in results), results


# ------------------------------------------------------------------------------ even inputs cost nothing
class _EightItems(IterableDataset):
    """Eight items on every rank, but an iterable dataset's length is not to be trusted."""

    def __iter__(self):
        return iter(range(8))


def count_allreduces(rank: int, world_size: int, kind: str) -> dict[str, int]:
    from lightning_ddpx.lightning.features.uneven import LockstepLoader, StepQueue

    loader = DataLoader(list(range(8)) if kind == "map" else _EightItems(), batch_size=1)
    calls = {"all_reduce": 0}
    real = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["all_reduce"] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        wrapped = LockstepLoader(loader, "join", dist.group.WORLD, torch.device("cpu"), StepQueue())
        batches = sum(1 for _ in wrapped)
    finally:
        dist.all_reduce = real
    return {"batches": batches, "all_reduce": calls["all_reduce"]}


@pytest.mark.slow
@pytest.mark.processes
def test_even_map_style_loaders_iterate_without_a_collective_per_batch() -> None:
    """Equal lengths of map-style loaders (what Lightning's DistributedSampler gives) prove equal batch
    counts: only the one length exchange at set-up. An IterableDataset's length proves nothing, so it
    still iterates in lockstep (one flag allreduce per batch, plus the final one)."""
    for result in run_distributed(count_allreduces, 2, "map", timeout=120):
        assert result == {"batches": 8, "all_reduce": 1}, result
    for result in run_distributed(count_allreduces, 2, "iterable", timeout=120):
        assert result["batches"] == 8 and result["all_reduce"] >= 9, result


# ------------------------------------------------------------------------ stateful loaders, mid-epoch resume
class ResumableLoader:
    """A loader with torchdata's ``state_dict``/``load_state_dict`` protocol: resumes after the batches it
    has yielded (Lightning saves it in checkpoints and restores it mid-epoch). Not a ``DataLoader``, so the
    lockstep looks one batch ahead of training."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.position, self.skip = batches, 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        start, self.skip = self.skip, 0
        for index in range(start, len(self.batches)):
            self.position = index + 1
            yield self.batches[index]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["position"]


def test_a_stateful_loaders_state_counts_only_the_batches_handed_to_training() -> None:
    from lightning_ddpx.lightning.features.uneven import LockstepLoader, StepQueue
    from tests.dist_utils import one_rank_group

    with one_rank_group():
        wrapped = LockstepLoader(
            ResumableLoader(list(range(5))), "join", dist.group.WORLD, torch.device("cpu"), StepQueue()
        )
        seen = [(batch, wrapped.state_dict()["position"]) for batch in wrapped]
        assert seen == [(k, k + 1) for k in range(5)]  # the batch fetched ahead is not counted
        # Lightning's _Stateful check reads attributes statically on Python 3.12+ (not __getattr__)
        from lightning.fabric.utilities.types import _Stateful

        assert isinstance(wrapped, _Stateful) and inspect.getattr_static(wrapped, "state_dict")
        assert not hasattr(
            LockstepLoader(
                DataLoader(list(range(3))), "join", dist.group.WORLD, torch.device("cpu"), StepQueue()
            ),
            "state_dict",
        )


class ResumableRegressor(TinyRegressor):
    def train_dataloader(self) -> ResumableLoader:
        x, y = rank_batches(self.trainer.global_rank, 8)
        return ResumableLoader([(x[k : k + 4], y[k : k + 4]) for k in range(0, 32, 4)])


def mid_epoch_resume_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    from lightning_ddpx import DDPXStrategy

    def train(max_steps: int, ckpt_path: str | None = None, **kwargs: Any) -> nn.Module:
        seed_everything(0, verbose=False)
        model = ResumableRegressor()
        trainer = make_trainer(
            DDPXStrategy(), max_steps, max_epochs=2, use_distributed_sampler=False, **kwargs
        )
        trainer.fit(model, ckpt_path=ckpt_path)
        return model

    continuous = parameters_of(train(-1))
    checkpoint = ModelCheckpoint(dirpath=directory, filename="mid", every_n_train_steps=3, save_top_k=1)
    train(3, enable_checkpointing=True, callbacks=[checkpoint])  # stops in the first epoch, after step 3
    resumed = parameters_of(train(-1, ckpt_path=os.path.join(directory, "mid.ckpt")))
    return {"continuous": continuous, "resumed": resumed}


@pytest.mark.processes
def test_a_mid_epoch_resume_with_a_stateful_loader_continues_exactly(tmp_path) -> None:
    """Lightning restores a stateful loader mid-epoch from its saved state: the batch the lockstep fetched
    ahead must not count, or the resumed run skips it."""
    for out in run_distributed(mid_epoch_resume_job, 2, str(tmp_path), init_process_group=False, timeout=240):
        for name, value in out["continuous"].items():
            assert torch.equal(out["resumed"][name], value), name
