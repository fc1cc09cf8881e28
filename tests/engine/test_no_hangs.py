"""A dead or stalled peer makes the other ranks raise a named error within the timeout, never hang."""

from __future__ import annotations

import time

import pytest

import lightning_ddpx
from lightning_ddpx.engine.agreement.errors import CommunicationError
from tests.dist_utils import run_distributed
from tests.engine.test_engine_oracle import SMALL_BUCKETS, mlp, mlp_loss

pytestmark = pytest.mark.processes

PG_TIMEOUT_S = 4.0


def peer_fails_mid_training(rank: int, world_size: int, how: str) -> dict:
    model = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    for step in range(3):  # past the rebuild, so the failure hits a bucket reduction
        mlp_loss(model, step).backward()
    if rank == 1:
        if how == "skips_backward":
            model(mlp_loss.__globals__["rank_batch"](rank, 9, (8, 16)))  # forward, then no backward
            time.sleep(PG_TIMEOUT_S + 6)
        return {"rank": 1}  # "exits": leaves the job (destroys its process group)
    started = time.monotonic()
    try:
        mlp_loss(model, 3).backward()
    except CommunicationError as error:
        return {"rank": 0, "seconds": time.monotonic() - started, "message": str(error)}
    return {"rank": 0, "seconds": time.monotonic() - started, "message": "no error"}


@pytest.mark.parametrize("how", ["skips_backward", "exits"])
def test_peer_failure_raises_named_error_within_timeout(how: str) -> None:
    result = run_distributed(peer_fails_mid_training, 2, how, pg_timeout=PG_TIMEOUT_S, timeout=90)[0]
    message = result["message"]
    assert result["seconds"] < PG_TIMEOUT_S + 3, result
    assert message.startswith("lightning_ddpx (rank 0)"), message
    assert "bucket" in message and "to be reduced by" in message, message
    assert f"after {PG_TIMEOUT_S:.0f} s" in message and "timeout=datetime.timedelta" in message, message
    expected_cause = (
        "no peer answered" if how == "skips_backward" else "the other rank (rank 1) exited or crashed"
    )
    assert expected_cause in message, message
