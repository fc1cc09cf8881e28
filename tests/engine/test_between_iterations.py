""" "Between iterations" is one rule, decided by the reducer: no bucket of this rank's backward is in flight.

A forward that armed the reducer and whose backward never ran (a skipped step, a forward for logging with
gradients enabled) leaves no bucket in flight, so everything allowed between iterations is allowed then
too: unfreezing a layer, loading a layout, registering a hook. Before the rule was one, the trainable-set
change passed the module's check (not reducing) and then failed the reducer's (not idle).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_ddpx import DistributedDataParallel
from lightning_ddpx.hooks import build_comm_hook
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.processes


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _unfreeze_after_an_armed_forward(rank: int, world_size: int) -> dict[str, Any]:
    net = _net()
    net[0].weight.requires_grad_(False)
    model = DistributedDataParallel(net)
    x = torch.randn(3, 4) + rank
    model(x)  # arms the reducer; its backward never runs (a skipped step)
    net[0].weight.requires_grad_(True)  # e.g. a fine-tuning callback unfreezes the first layer now
    model(x).sum().backward()
    planned = [name for bucket in model.bucket_plan() for name in bucket.parameter_names]
    return {"grad": net[0].weight.grad.clone(), "planned": planned}


def test_a_layer_unfrozen_after_a_forward_without_backward_joins_the_reduction() -> None:
    results = run_distributed(_unfreeze_after_an_armed_forward, 2)
    assert all("0.weight" in r["planned"] for r in results)
    torch.testing.assert_close(results[0]["grad"], results[1]["grad"], rtol=0, atol=0)  # averaged
    assert results[0]["grad"].abs().sum() > 0


def _guarded_calls_while_reducing(rank: int, world_size: int) -> list[str]:
    model = DistributedDataParallel(_net())
    refused: list[str] = []
    attempts = {
        "no_sync": lambda: model.no_sync().__enter__(),
        "verify_replicas": lambda: model.verify_replicas(),
        "register_comm_hook": lambda: model.register_comm_hook(*build_comm_hook("allreduce")),
        "overlap_optimizer_with": lambda: model.overlap_optimizer_with(None),
    }

    def during_backward(grad: torch.Tensor) -> torch.Tensor:
        for name, attempt in attempts.items():
            try:
                attempt()
            except RuntimeError:
                refused.append(name)
        return grad

    # the last layer's bias is ready first: by the first layer's hook its bucket may be launched
    model.module[0].weight.register_hook(during_backward)
    model(torch.randn(3, 4)).sum().backward()
    return refused


@pytest.mark.parametrize("world_size", [2])
def test_every_between_iterations_call_is_refused_while_this_rank_reduces(world_size: int) -> None:
    for refused in run_distributed(_guarded_calls_while_reducing, world_size):
        assert sorted(refused) == [
            "no_sync",
            "overlap_optimizer_with",
            "register_comm_hook",
            "verify_replicas",
        ]
