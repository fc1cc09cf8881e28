"""Hang diagnosis: errors say what the other ranks were last doing; DDPX_DEBUG=1 names the rank out of step."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from tests.dist_utils import run_distributed
from tests.oracle import rank_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.processes]

SMALL_BUCKETS = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _step(model: nn.Module, step: int, backward: bool = True) -> None:
    loss = model(rank_batch(dist.get_rank(), step, (8, 16))).pow(2).mean()
    if backward:
        loss.backward()


def skip_a_backward(rank: int, world_size: int, hook: str | None) -> str:
    """With DDPX_DEBUG=1, rank 1 runs one forward without its backward at step 2."""
    os.environ["DDPX_DEBUG"] = "1"
    model = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    if hook is not None:
        model.register_comm_hook(*lightning_ddpx.hooks.build_comm_hook(hook))
    try:
        for step in range(4):
            if rank == 1 and step == 2:
                _step(model, step, backward=False)  # forgot the backward of this forward
            _step(model, step)
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("hook", [None, "powersgd"], ids=["default_hook_inline", "powersgd_comm_thread"])
def test_debug_sequence_check_names_the_rank_and_bucket_on_every_rank(hook: str | None) -> None:
    started = time.monotonic()
    results = run_distributed(skip_a_backward, 2, hook, timeout=60, pg_timeout=30)
    assert time.monotonic() - started < 30, "the check must fire at once, not after the collective timeout"
    for message in results:
        assert "DDPX_DEBUG=1" in message and "rank 1 is about to reduce bucket 0" in message, message
        assert "synchronising forwards 4" in message and "synchronising forwards 3" in message, message


def stall(rank: int, world_size: int) -> str:
    """Rank 1 stops after 2 steps (alive, but in no collective); rank 0 goes on and times out."""
    model = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    steps = 2 if rank == 1 else 3
    for step in range(steps):
        _step(model, step)
        time.sleep(0.6)  # let the rate-limited progress record reach the store
    if rank == 1:
        time.sleep(8)
        return "stalled"
    return "no error"


def run_stall(rank: int, world_size: int) -> str:
    try:
        return stall(rank, world_size)
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"


def test_timeout_error_reports_what_the_other_rank_last_did() -> None:
    results = run_distributed(run_stall, 2, timeout=60, pg_timeout=3)
    message = results[0]
    assert message.startswith("CommunicationError"), message
    assert "no peer answered within 3 s" in message and "while waiting for bucket 0" in message, message
    # what rank 0 waits for: bucket, iteration, hook
    assert "of iteration 3 to be reduced by" in message, message
    assert "Other ranks, last started: rank 1: bucket" in message and "in iteration 2" in message, message
    assert "not failed since" in message, message
    assert results[1] == "stalled"
