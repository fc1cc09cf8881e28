"""Bad input fails with an error that names the culprit and the fix, on every rank, before work is lost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_ddpx
from tests.dist_utils import run_distributed
from tests.engine.test_engine_oracle import SMALL_BUCKETS, mlp, mlp_loss


def message_of(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), "25"])
def test_bucket_cap_must_be_positive(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        lightning_ddpx.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=cap)


def test_needs_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        lightning_ddpx.DistributedDataParallel(nn.Linear(2, 2))


class Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(16, 4)
        self.skipped = nn.Linear(16, 4)

    def forward(self, x):
        return self.used(x)


def engine_errors(rank: int, world_size: int) -> dict:
    out = {}
    # A model that differs on rank 1: every rank must raise, naming the parameter and the ranks' values.
    width = 5 if rank == 1 else 4
    out["mismatch"] = message_of(
        lambda: lightning_ddpx.DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, width)))
    )
    frozen = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    frozen[0].bias.requires_grad_(rank == 0)
    out["requires_grad"] = message_of(lambda: lightning_ddpx.DistributedDataParallel(frozen))
    mixed = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    out["devices"] = message_of(lambda: lightning_ddpx.DistributedDataParallel(mixed))

    # A parameter that gets no gradient without find_unused_parameters.
    model = lightning_ddpx.DistributedDataParallel(Skips(), **SMALL_BUCKETS)
    out["unused"] = message_of(lambda: mlp_loss(model, 0).backward())
    model.module.skipped.requires_grad_(False)  # not a fix for an existing wrapper, but must not hang

    # Hooks: wrong signature, twice, after the first backward, wrong-sized result.
    model = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    out["signature"] = message_of(lambda: model.register_comm_hook(None, lambda bucket: bucket))

    def wrong_size(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer()[:-1])
        return future

    model.register_comm_hook(None, wrong_size)
    out["twice"] = message_of(lambda: model.register_comm_hook(None, wrong_size))
    out["wrong_size"] = message_of(lambda: mlp_loss(model, 0).backward())

    def integer_result(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer().to(torch.int32))
        return future

    wrong_dtype = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    wrong_dtype.register_comm_hook(None, integer_result)
    out["wrong_dtype"] = message_of(lambda: mlp_loss(wrong_dtype, 0).backward())

    late = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    mlp_loss(late, 0).backward()
    out["late"] = message_of(lambda: late.register_comm_hook(None, wrong_size))

    failing = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)

    def raising(state, bucket):
        raise ValueError("deliberate failure in a user hook")

    failing.register_comm_hook(None, raising)
    out["hook_raises"] = message_of(lambda: mlp_loss(failing, 0).backward())
    # After a failed iteration the module is usable again (state was reset, nothing hangs).
    out["after_failure"] = message_of(lambda: mlp_loss(late, 1).backward())

    # A second backward of one synchronised forward would leave its gradients local to each rank.
    twice = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    loss = mlp_loss(twice, 0)
    loss.backward(retain_graph=True)
    out["second_backward"] = message_of(lambda: loss.backward(retain_graph=True))
    with twice.no_sync():  # the same thing asked for explicitly is fine: local accumulation
        out["second_backward_in_no_sync"] = message_of(lambda: loss.backward())
    out["after_second_backward"] = message_of(lambda: mlp_loss(twice, 1).backward())
    # torch's DDP lets a backward through .module pass (local gradients), e.g. evaluating the raw module on
    # one rank after training: so does ours (only a second backward through the wrapper's outputs is refused;
    # a LocalGradientWarning names it once, see tests/engine/test_late_gradients.py)
    out["module_backward"] = message_of(lambda: twice.module(torch.ones(2, 16)).sum().backward())
    return out


@pytest.mark.processes
def test_engine_errors_name_the_culprit_and_the_fix():
    results = run_distributed(engine_errors, 2)
    for rank, out in enumerate(results):
        assert "ModelMismatchError" in out["mismatch"] and "'1.weight'" in out["mismatch"], out["mismatch"]
        assert "rank 0: (4, 3)" in out["mismatch"] and "rank 1: (5, 3)" in out["mismatch"]
        assert "'0.bias'" in out["requires_grad"] and "requires_grad" in out["requires_grad"]
        assert "one device" in out["devices"] and "'1.weight'" in out["devices"] and "meta" in out["devices"]
        assert "'skipped.weight'" in out["unused"] and "find_unused_parameters=True" in out["unused"]
        assert "ddpx_find_unused_parameters_true" in out["unused"] and f"rank {rank}" in out["unused"]
        assert "TypeError" in out["signature"] and "hook(state, bucket)" in out["signature"]
        assert "already registered" in out["twice"]
        assert "bucket 0" in out["wrong_size"] and "same size as bucket.buffer()" in out["wrong_size"]
        assert "torch.int32" in out["wrong_dtype"] and "floating dtype" in out["wrong_dtype"], out[
            "wrong_dtype"
        ]
        assert "before the first backward" in out["late"]
        assert "deliberate failure" in out["hook_raises"] and "bucket 0" in out["hook_raises"]
        assert out["after_failure"] == "no error"
        second = out["second_backward"]
        assert second.startswith(f"RuntimeError: lightning_ddpx (rank {rank}): a second backward"), second
        assert "already synchronised" in second and "no_sync()" in second and "one backward" in second
        assert out["second_backward_in_no_sync"] == "no error"
        assert out["after_second_backward"] == "no error"
        assert out["module_backward"] == "no error"
