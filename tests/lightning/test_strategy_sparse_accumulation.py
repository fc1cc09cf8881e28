"""Through the Trainer: a sparse embedding, and a layer used only in accumulated micro-batches, like "ddp".

``accumulate_grad_batches`` runs all but the last micro-batch of each optimizer step in ``no_sync()``. The
module below uses a sparse ``nn.Embedding``, and on rank 0 a ``side`` layer only in the first micro-batch of
each step: the ranks must average ``side``'s accumulated gradient at the synchronised micro-batch, as torch's
DDP does under ``strategy="ddp_find_unused_parameters_true"``. Both strategies train from the same seed on the
same rank-dependent data; the parameters must agree within 1e-6 after training.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything
from torch import nn

from tests.dist_utils import run_distributed
from tests.strategy_helpers import TinyRegressor, fit, parameters_of, quiet

pytestmark = [pytest.mark.slow, pytest.mark.processes]

ACCUMULATE = 3
STEPS = 3


class SparseWithSide(TinyRegressor):
    """Indices from the data feed a sparse embedding; ``side`` joins the loss on rank 0, first micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.side = nn.Linear(4, 4)
        self.layouts: set[str] = set()  # of the embedding's gradient when the optimizer steps

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.layouts.add(str(self.emb.weight.grad.layout))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        idx = (x[:, :2].abs() * 7).long() % 20
        out = self(x) + self.net[0](self.emb(idx).mean(1))[:, :4]
        if self.global_rank == 0 and batch_idx % ACCUMULATE == 0:
            out = out + self.side(out)
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # sparse gradients: no momentum


def train(rank: int, world_size: int) -> dict[str, Any]:
    quiet()
    seed_everything(0, verbose=False)
    out: dict[str, Any] = {"initial": parameters_of(SparseWithSide())}
    for name in ("ddp_find_unused_parameters_true", "ddpx_find_unused_parameters_true"):
        _, model = fit(name, max_steps=STEPS, model_cls=SparseWithSide, accumulate_grad_batches=ACCUMULATE)
        out[name] = parameters_of(model)
        out[f"{name}/layouts"] = sorted(model.layouts)
    return out


def test_sparse_embedding_and_a_layer_used_in_accumulated_micro_batches_train_like_ddp() -> None:
    results = run_distributed(train, 2, init_process_group=False, timeout=300, pg_timeout=120)
    for rank, result in enumerate(results):
        ours, theirs = result["ddpx_find_unused_parameters_true"], result["ddp_find_unused_parameters_true"]
        for name in theirs:
            torch.testing.assert_close(
                ours[name],
                theirs[name],
                rtol=1e-6,
                atol=1e-7,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )
        assert result["ddpx_find_unused_parameters_true/layouts"] == ["torch.sparse_coo"]
        for name in ("side.weight", "emb.weight"):  # both trained, on the rank that never used side too
            assert not torch.equal(ours[name], result["initial"][name]), name
