"""Two CPU ranks on one machine sum buckets through shared memory (lightning_ddpx.engine.shared_memory).

The sums themselves are checked against torch's DDP bit for bit in tests/test_engine_oracle.py and
tests/test_join_oracle.py. Here: the set-up's own checks in one process (another machine's file, a full
/dev/shm), the agreement that makes every rank fall back to gloo when any rank cannot take part, that
nothing is left in /dev/shm, and slots that are never overwritten while the other rank reads them, with
ranks drifting apart in time.
"""

from __future__ import annotations

import copy
import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from lightning_ddpx.engine import shared_memory
from tests.dist_utils import run_distributed
from tests.oracle import assert_same_tensors, default_path, rank_batch, set_shared_memory, train_side_by_side

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------- one process
def test_map_accepts_only_the_file_rank_0_made() -> None:
    total = 4096
    path, token, refusal = shared_memory._create(total)
    assert path is not None and token is not None and refusal is None
    try:
        mapped = shared_memory._map(path, token, total)
        assert mapped is not None and mapped[0].numel() == total
        assert shared_memory._map(path, b"x" * len(token), total) is None, "another machine's token"
        assert shared_memory._map(path, token, total + 64) is None, "another size"
        assert shared_memory._map(path + "_elsewhere", token, total) is None, "no such file here"
    finally:
        os.unlink(path)


def test_create_refuses_when_dev_shm_lacks_room(monkeypatch: pytest.MonkeyPatch) -> None:
    free = os.statvfs("/dev/shm")
    monkeypatch.setattr(shared_memory, "_HEADROOM_BYTES", free.f_bavail * free.f_frsize)
    path, token, refusal = shared_memory._create(4096)
    assert path is None and token is None
    assert refusal is not None and "MiB free" in refusal and "--shm-size" in refusal


@pytest.mark.parametrize("seed", range(20))
def test_slots_hold_every_bucket_layout(seed: int) -> None:
    """Any partition of the parameters into buckets (whole parameters each) fits the slots' bound."""
    rng = random.Random(seed)
    sizes = [
        rng.choice([1, 3, 4, 62, 4096, 100_003]) * rng.choice([2, 4, 8]) for _ in range(rng.randint(1, 40))
    ]
    rng.shuffle(sizes)
    cuts = sorted(rng.sample(range(1, len(sizes)), rng.randint(0, len(sizes) - 1))) if len(sizes) > 1 else []
    buckets = [sum(sizes[a:b]) for a, b in zip([0, *cuts], [*cuts, len(sizes)])]
    used = sum(shared_memory._aligned(nbytes) for nbytes in buckets)
    assert used <= shared_memory.region_bytes_bound(sizes)


# ------------------------------------------------------------------------------- two ranks
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def mlp_loss(model: nn.Module, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return model(rank_batch(rank, step, (8, 16))).pow(2).mean() * (rank + 1)


def _our_files() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"lightning_ddpx_{os.getpid()}_")]


def run_refusal(rank: int, world_size: int, how: str) -> dict:
    """Rank 1 cannot take part (``how``); both ranks must fall back to gloo and still match torch."""
    if rank == 1 and how == "switched_off":
        set_shared_memory(False)
    if rank == 1 and how == "another_machine":  # the file rank 0 announces does not exist here
        real_map = shared_memory._map
        shared_memory._map = lambda path, token, total: real_map(path + "_elsewhere", token, total)
    model = lightning_ddpx.DistributedDataParallel(mlp())
    result = train_side_by_side(rank, mlp, mlp_loss, 4, rtol=0, atol=0)
    return {
        **result,
        "refusal": model.reducer.shared_memory_refusal,
        "files_left": _our_files() if rank == 0 else [],
    }


@pytest.mark.parametrize("how", ["switched_off", "another_machine"])
def test_every_rank_falls_back_to_gloo_when_one_cannot_take_part(how: str) -> None:
    results = run_distributed(run_refusal, 2, how)
    assert [result["path"] for result in results] == ["whole", "whole"]
    assert results[0]["files_left"] == []
    refusals = [result["refusal"] for result in results]  # each rank says why, naming the cause on rank 1
    assert "could not map" in refusals[0], refusals
    expected = (
        "DDPX_SHARED_MEMORY=0 in this rank's environment"
        if how == "switched_off"
        else "not on this rank's machine"
    )
    assert expected in refusals[1], refusals


def run_construction(rank: int, world_size: int) -> dict:
    model = lightning_ddpx.DistributedDataParallel(mlp())
    return {
        "path": default_path(model),
        "refusal": model.reducer.shared_memory_refusal,
        "files_left": _our_files() if rank == 0 else [],
    }


def test_the_shared_file_is_gone_once_every_rank_mapped_it() -> None:
    results = run_distributed(run_construction, 2)
    assert [result["path"] for result in results] == ["shared_memory"] * 2
    assert [result["refusal"] for result in results] == [None, None]
    assert results[0]["files_left"] == []


def test_three_ranks_say_why_they_use_gloo() -> None:
    for result in run_distributed(run_construction, 3):
        assert result["path"] == "whole" and "3 ranks" in result["refusal"], result


class Deep(nn.Module):
    """Twelve small layers: with tiny caps, several buckets in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rng = random.Random(1000 * dist.get_rank() + int(x.abs().sum().item() * 1000) % 997)
        for layer in self.layers:
            x = torch.tanh(layer(x))
            # this rank falls behind (or runs ahead) by up to 3 ms, here and in backward
            if rng.random() < 0.3:
                delay = rng.random() * 0.003
                time.sleep(delay)
                x.register_hook(lambda grad, delay=delay: time.sleep(delay) or grad)
        return x


def deep_loss(model: nn.Module, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return model(rank_batch(rank, step, (8, 24))).pow(2).mean() * (rank + 1)


def run_drifting(rank: int, world_size: int) -> dict:
    """Ours for 25 steps, then torch's (not interleaved: torch's collectives would realign the ranks).
    Rank 1 reads rank 0's slots late (15 ms per bucket), while rank 0 runs on into its next iteration."""
    if rank == 1:
        add = shared_memory.SharedMemoryExchange._add

        def late_add(mine: torch.Tensor, other: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            time.sleep(0.015)
            return add(mine, other, out)

        shared_memory.SharedMemoryExchange._add = staticmethod(late_add)  # type: ignore[method-assign]
    torch.manual_seed(0)
    base = Deep()
    ours = lightning_ddpx.DistributedDataParallel(
        copy.deepcopy(base), bucket_cap_mb=0.003, first_bucket_cap_mb=0.001
    )
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.003)
    trained = [_train_recording_grads(model, 25) for model in (ours, theirs)]
    for step, (a, b) in enumerate(zip(*trained)):
        assert_same_tensors(a, b, f"rank {rank} step {step} grad", rtol=0, atol=0)
    return {"path": default_path(ours), "buckets": len(ours.bucket_plan())}


def _train_recording_grads(model: nn.Module, steps: int) -> list[dict[str, torch.Tensor | None]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in range(steps):
        optimizer.zero_grad()
        deep_loss(model, step).backward()
        grads.append({name: p.grad.clone() for name, p in model.module.named_parameters()})
        optimizer.step()
    return grads


def test_slots_survive_ranks_drifting_apart() -> None:
    """Ranks sleep at random points of forward and backward, so one rank's next iteration overlaps the
    other's adds: with the slots reused too early the sums would mix iterations and differ from torch's."""
    results = run_distributed(run_drifting, 2, timeout=180)
    assert [result["path"] for result in results] == ["shared_memory"] * 2
    assert results[0]["buckets"] >= 6, results[0]["buckets"]


def run_dtype(rank: int, world_size: int, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    return train_side_by_side(
        rank, lambda: mlp().to(dtype), lambda m, s: mlp_loss_as(m, s, dtype), 4, rtol=0, atol=0
    )


def mlp_loss_as(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    rank = dist.get_rank()
    return model(rank_batch(rank, step, (8, 16)).to(dtype)).float().pow(2).mean() * (rank + 1)


@pytest.mark.parametrize("dtype_name", ["float64", "bfloat16", "float16"])
def test_other_dtypes_sum_bit_identically_to_torch(dtype_name: str) -> None:
    results = run_distributed(run_dtype, 2, dtype_name)
    assert [result["path"] for result in results] == ["shared_memory"] * 2
