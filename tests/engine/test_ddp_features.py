"""Lightning features behave with "ddpx" exactly as with "ddp", and Lightning's / torch's
DDP arguments given to DDPXStrategy act as documented.

All runs happen in ONE 2-process job (module fixture), each feature trained with ``strategy="ddp"`` (torch's
DDP under Lightning) and with ``"ddpx"`` from the same seed on the same rank-dependent data; each test then
compares one feature's results. Tolerances: 1e-6 where both runs do the same fp32 arithmetic, looser for
bf16 autocast (stated at the test).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from tests.dist_utils import run_distributed
from tests.strategy_helpers import BATCH_SIZE, TinyRegressor, dataset, fit, parameters_of, quiet

pytestmark = [pytest.mark.slow, pytest.mark.processes]

STEPS = 4
PAIR = ("ddp", "ddpx")


class EvalRegressor(TinyRegressor):
    """TinyRegressor with test and predict loops (validation comes with TinyRegressor)."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def test_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=BATCH_SIZE * 2, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=BATCH_SIZE * 2, shuffle=False)


class Checkpointed(TinyRegressor):
    """Every parameter inside ``torch.utils.checkpoint``: two blocks, recomputed in backward."""

    use_reentrant = False

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reentrant:  # reentrant checkpoints pass gradients only to inputs that require them
            x = x.detach().requires_grad_()
        for block in self.net:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return x


class CheckpointedReentrant(Checkpointed):
    use_reentrant = True


class WithBatchNorm(TinyRegressor):
    """BatchNorm between the layers: with sync_batchnorm=True its statistics are over both ranks' batches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


class UnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused_head = nn.Linear(8, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def fabric_with_lightning_arguments(rank: int, out: dict) -> None:
    """Fabric's DDPX strategy with Lightning's hook names and torch's static_graph, against torch's DDP with
    the same hook and static_graph=True driven by hand (Fabric's own DDPStrategy ignores hooks on CPU)."""
    import copy

    from lightning.fabric import Fabric
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPXStrategy

    strategy = FabricDDPXStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook, static_graph=True)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    base = UnusedHead()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(base), static_graph=True)
    reference.register_comm_hook(None, default_hooks.fp16_compress_hook)
    model = copy.deepcopy(base)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    out["fabric/ours"] = parameters_of(model.module)
    out["fabric/torch"] = parameters_of(reference.module)


def run_features(rank: int, world_size: int, checkpoint_root: str) -> dict:
    quiet()
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_ddpx import DDPXStrategy

    out: dict = {}
    for name in PAIR:
        _, model = fit(name, max_steps=STEPS, precision="bf16-mixed")
        out[f"bf16/{name}"] = parameters_of(model)

        _, model = fit(name, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05)
        out[f"clip_norm/{name}"] = parameters_of(model)
        _, model = fit(
            name,
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.01,
            gradient_clip_algorithm="value",
        )
        out[f"clip_value/{name}"] = parameters_of(model)

        for model_cls in (Checkpointed, CheckpointedReentrant):
            _, model = fit(name, max_steps=STEPS, model_cls=model_cls)
            out[f"{model_cls.__name__}/{name}"] = parameters_of(model)

        trainer, model = fit(name, max_steps=STEPS, model_cls=EvalRegressor, limit_val_batches=2)
        out[f"eval/{name}/params"] = parameters_of(model)
        out[f"eval/{name}/validate"] = trainer.validate(model, verbose=False)
        out[f"eval/{name}/test"] = trainer.test(model, verbose=False)
        out[f"eval/{name}/predict"] = torch.cat(trainer.predict(model))
        out[f"eval/{name}/params_after"] = parameters_of(model)

        try:  # torch's SyncBatchNorm has GPU kernels only: on CPU both must refuse it before training
            fit(name, max_steps=STEPS, model_cls=WithBatchNorm, sync_batchnorm=True)
            out[f"syncbn/{name}"] = "trained"
        except ValueError as error:
            out[f"syncbn/{name}"] = str(error)

        directory = Path(checkpoint_root) / name
        callback = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)
        _, model = fit(name, max_steps=6, enable_checkpointing=True, callbacks=[callback])
        dist.barrier()
        files = sorted(directory.glob("*.ckpt"))
        out[f"ckpt/{name}/files"] = [f.name for f in files]
        loaded = [torch.load(f, weights_only=True) for f in files]
        out[f"ckpt/{name}/steps"] = [c["global_step"] for c in loaded]
        out[f"ckpt/{name}/weights"] = [c["state_dict"] for c in loaded]
        out[f"ckpt/{name}/final"] = state_of(model)

    # Part 1: Lightning's spellings and torch's wrappers on DDPXStrategy, equal to our own names.
    for key, strategy in (
        ("fp16_hook/ours", DDPXStrategy(comm_hook="fp16")),
        ("fp16_hook/lightning", DDPXStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)),
        ("wrapped/ours", DDPXStrategy(comm_hook="allreduce", comm_wrapper="bf16")),
        (
            "wrapped/lightning",
            DDPXStrategy(
                ddp_comm_hook=default_hooks.allreduce_hook,
                ddp_comm_wrapper=default_hooks.bf16_compress_wrapper,
            ),
        ),
        ("plain", "ddpx"),
        (
            "torch_kwargs",
            DDPXStrategy(
                forward_sync_buffers=True, skip_all_reduce_unused_params=True, batched_grad_copy=True
            ),
        ),
    ):
        _, model = fit(strategy, max_steps=STEPS)
        out[f"args/{key}"] = parameters_of(model)

    # static_graph=True through the Trainer, with gradient accumulation and reentrant checkpointing.
    for key, model_cls, extra in (
        ("accumulate", TinyRegressor, {"accumulate_grad_batches": 2}),
        ("reentrant", CheckpointedReentrant, {}),
    ):
        _, model = fit(DDPXStrategy(static_graph=True), max_steps=STEPS, model_cls=model_cls, **extra)
        out[f"static/{key}"] = parameters_of(model)
        _, model = fit("ddp", max_steps=STEPS, model_cls=model_cls, **extra)
        out[f"static/{key}/ddp"] = parameters_of(model)

    fabric_with_lightning_arguments(rank, out)

    # init_sync=False: ranks keep their own initial weights (torch's meaning); True broadcasts rank 0's.
    for init_sync in (True, False):
        _, model = fit(DDPXStrategy(init_sync=init_sync), max_steps=1, seed=rank, limit_train_batches=0)
        out[f"init_sync/{init_sync}"] = parameters_of(model)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("checkpoints"))
    return run_distributed(run_features, 2, root, init_process_group=False, timeout=400, pg_timeout=120)


def assert_same(actual: Any, expected: Any, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def test_bf16_mixed_precision_matches_ddp(results):
    # Same autocast arithmetic on both sides; only the order of the fp32 gradient sums may differ.
    for rank_out in results:
        assert_same(rank_out["bf16/ddpx"], rank_out["bf16/ddp"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["clip_norm", "clip_value"])
def test_gradient_clipping_with_accumulation_matches_ddp(results, kind):
    for rank_out in results:
        assert_same(rank_out[f"{kind}/ddpx"], rank_out[f"{kind}/ddp"])
    # both clipping algorithms were active: they end in different weights
    assert not torch.equal(
        results[0]["clip_norm/ddpx"]["net.0.weight"], results[0]["clip_value/ddpx"]["net.0.weight"]
    )


@pytest.mark.parametrize("model", ["Checkpointed", "CheckpointedReentrant"])
def test_activation_checkpointing_matches_ddp(results, model):
    for rank_out in results:
        assert_same(rank_out[f"{model}/ddpx"], rank_out[f"{model}/ddp"])


def test_validate_test_predict_after_fit_match_ddp(results):
    for rank_out in results:
        assert_same(rank_out["eval/ddpx/params"], rank_out["eval/ddp/params"])
        for loop in ("validate", "test"):
            ours, theirs = rank_out[f"eval/ddpx/{loop}"], rank_out[f"eval/ddp/{loop}"]
            assert ours[0].keys() == theirs[0].keys()
            for key in theirs[0]:
                assert ours[0][key] == pytest.approx(theirs[0][key], rel=1e-6), (loop, key)
        assert_same(rank_out["eval/ddpx/predict"], rank_out["eval/ddp/predict"])
        # evaluation changes no weights
        assert_same(rank_out["eval/ddpx/params_after"], rank_out["eval/ddpx/params"], rtol=0, atol=0)
    assert not torch.equal(
        results[0]["eval/ddpx/predict"], results[1]["eval/ddpx/predict"]
    )  # rank's own data


def test_sync_batchnorm_on_cpu_is_refused_before_training_like_ddp(results):
    """torch's SyncBatchNorm has GPU kernels only; tests/engine/test_cuda.py compares sync_batchnorm training on GPUs."""
    for rank_out in results:
        assert rank_out["syncbn/ddp"] == "SyncBatchNorm layers only work with GPU modules"
        assert (
            "layer 'net.1' is a SyncBatchNorm, which torch implements for GPUs only"
            in rank_out["syncbn/ddpx"]
        )
        assert "sync_batchnorm=False" in rank_out["syncbn/ddpx"]


def test_model_checkpoint_every_n_train_steps_matches_ddp(results):
    rank_out = results[0]
    assert rank_out["ckpt/ddpx/files"] == rank_out["ckpt/ddp/files"]
    assert rank_out["ckpt/ddpx/steps"] == rank_out["ckpt/ddp/steps"] == [2, 4, 6]
    for ours, theirs in zip(rank_out["ckpt/ddpx/weights"], rank_out["ckpt/ddp/weights"]):
        assert_same(ours, theirs)
    assert_same(rank_out["ckpt/ddpx/final"], rank_out["ckpt/ddpx/weights"][-1], rtol=0, atol=0)


@pytest.mark.parametrize(
    "ours, lightning", [("fp16_hook/ours", "fp16_hook/lightning"), ("wrapped/ours", "wrapped/lightning")]
)
def test_lightning_hook_arguments_equal_our_names(results, ours, lightning):
    """torch's fp16 hook and bf16 wrapper given by Lightning's names train exactly like our equivalents."""
    for rank_out in results:
        assert_same(rank_out[f"args/{lightning}"], rank_out[f"args/{ours}"], rtol=0, atol=0)
        assert not torch.equal(
            rank_out[f"args/{ours}"]["net.0.weight"], rank_out["args/plain"]["net.0.weight"]
        )


def test_harmless_torch_arguments_change_nothing(results):
    for rank_out in results:
        assert_same(rank_out["args/torch_kwargs"], rank_out["args/plain"], rtol=0, atol=0)


@pytest.mark.parametrize("key", ["accumulate", "reentrant"])
def test_static_graph_in_the_trainer_matches_ddp(results, key):
    for rank_out in results:
        assert_same(rank_out[f"static/{key}"], rank_out[f"static/{key}/ddp"])


def test_fabric_takes_lightnings_hook_names_and_static_graph(results):
    for rank_out in results:
        assert_same(rank_out["fabric/ours"], rank_out["fabric/torch"], rtol=1e-3, atol=1e-4)  # fp16 hook
        assert "unused_head.weight" in rank_out["fabric/ours"]


def test_init_sync_false_keeps_each_ranks_weights(results):
    synced = [r["init_sync/True"]["net.0.weight"] for r in results]
    unsynced = [r["init_sync/False"]["net.0.weight"] for r in results]
    assert torch.equal(synced[0], synced[1])
    assert not torch.equal(unsynced[0], unsynced[1])


def _replaced_buffer_is_broadcast(rank: int, world_size: int) -> dict:
    import torch.nn as nn

    from lightning_ddpx import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    bn = model.module[1]
    bn.eval()  # running statistics are used, not updated: what forward sees is what was broadcast
    bn.running_mean = torch.full((3,), float(rank + 5))  # replaced by assignment after wrapping
    with torch.no_grad():
        out = model(torch.ones(2, 3))
    return {"running_mean": bn.running_mean.clone(), "out": out}


@pytest.mark.slow
def test_a_buffer_replaced_after_wrapping_is_still_broadcast():
    """Buffers are found once at construction (no walk of every submodule each step) but looked up by name,
    so a buffer replaced by assignment is still rank 0's before forward."""
    results = run_distributed(_replaced_buffer_is_broadcast, 2)
    for result in results:
        torch.testing.assert_close(result["running_mean"], torch.full((3,), 5.0))
    torch.testing.assert_close(results[0]["out"], results[1]["out"])
