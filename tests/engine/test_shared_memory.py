"""Two CPU ranks on one machine sum buckets through shared memory (lightning_ddpx.engine.transport.shared_memory).

The sums themselves are checked against torch's DDP bit for bit in tests/engine/test_engine_oracle.py and
tests/engine/test_join_oracle.py. Here: the set-up's own checks in one process (another machine's file, a full
/dev/shm, a container's memory limit, a file that never has a name), the agreement that makes every rank
fall back to gloo when any rank cannot take part -- without a collective of its own when it is switched
off --, a rank killed in the middle of the set-up (nothing left in /dev/shm, our named error on the
other), and slots that are never overwritten while the other rank reads them, with ranks drifting apart
in time.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from lightning_ddpx.engine.transport import shared_memory
from lightning_ddpx.engine.transport.cgroup_memory import cgroup_memory_room
from tests.dist_utils import free_port, job_env, one_rank_group, run_distributed, run_jobs
from tests.oracle import assert_same_tensors, default_path, rank_batch, set_shared_memory, train_side_by_side

pytestmark = pytest.mark.timeout(120)
MIB = 2**20


# ------------------------------------------------------------------------------- one process
def _dev_shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_rank_1_maps_only_the_file_rank_0_made() -> None:
    total = 4096
    fd, token, refusal = shared_memory._create(total)
    assert fd is not None and token is not None and refusal is None
    pid = os.getpid()
    try:
        mapping, refusal = shared_memory._open_rank0_file(pid, fd, token, total)
        assert mapping is not None and refusal is None and len(mapping) == total
        mapping.close()
        mapping, refusal = shared_memory._open_rank0_file(pid, fd, b"x" * len(token), total)
        assert mapping is None and "another token" in refusal and "different machines" in refusal
        mapping, refusal = shared_memory._open_rank0_file(pid, fd, token, total + 64)
        assert mapping is None and "another size" in refusal
        closed = max(int(name) for name in _open_descriptors()) + 100
        mapping, refusal = shared_memory._open_rank0_file(pid, closed, token, total)
        assert (
            mapping is None and f"/proc/{pid}/fd/{closed}" in refusal and "cannot be opened here" in refusal
        )
    finally:
        os.close(fd)


@pytest.mark.parametrize("o_tmpfile", [True, False], ids=["O_TMPFILE", "named_then_unlinked"])
def test_the_shared_file_never_stays_in_dev_shm(o_tmpfile: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file rank 0 creates has no name in /dev/shm by the time ``_create`` returns, before any
    collective: a rank that dies later leaves nothing there (the job test below kills one)."""
    if not o_tmpfile:  # a file system without O_TMPFILE: created with a name, unlinked at once
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    before = _dev_shm_names()
    fd, token, refusal = shared_memory._create(8192)
    assert refusal is None and fd is not None
    try:
        assert _dev_shm_names() - before == set()
        assert os.fstat(fd).st_size == 8192 and os.fstat(fd).st_nlink == 0
        assert os.pread(fd, len(token), 0) == token
    finally:
        os.close(fd)


def test_an_interrupted_set_up_releases_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or any exception) between creating the file and mapping it: the descriptor is closed, so the
    memory goes at once, and nothing has a name in /dev/shm."""

    def interrupted(fd: int, total: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(shared_memory, "_map_own", interrupted)
    before_names, before_fds = _dev_shm_names(), _open_descriptors()
    with one_rank_group(), pytest.raises(KeyboardInterrupt):
        shared_memory.open_exchange(dist.group.WORLD, [4096])
    assert _dev_shm_names() - before_names == set()
    leaked = [os.readlink(f"/proc/self/fd/{n}") for n in _open_descriptors() - before_fds if n.isdigit()]
    assert not [target for target in leaked if target.startswith("/dev/shm")], leaked


def test_create_refuses_when_dev_shm_lacks_room(monkeypatch: pytest.MonkeyPatch) -> None:
    free = os.statvfs("/dev/shm")
    monkeypatch.setattr(shared_memory, "_HEADROOM_BYTES", free.f_bavail * free.f_frsize)
    fd, token, refusal = shared_memory._create(4096)
    assert fd is None and token is None
    assert refusal is not None and "MiB free" in refusal and "--shm-size" in refusal


def test_create_refuses_when_the_container_limit_lacks_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_memory, "cgroup_memory_room", lambda: 100 * MIB)
    before = _dev_shm_names()
    fd, token, refusal = shared_memory._create(60 * MIB)
    assert fd is None and token is None and _dev_shm_names() == before
    assert refusal is not None and "memory limit (cgroup) leaves 100 MiB" in refusal, refusal


def test_room_refusal_weighs_dev_shm_and_the_container_limit() -> None:
    slots = 400 * MIB
    assert shared_memory.room_refusal(slots, 10_000 * MIB, None) is None
    assert shared_memory.room_refusal(slots, 10_000 * MIB, 800 * MIB) is None  # half of what is left
    too_small = shared_memory.room_refusal(slots, slots + 63 * MIB, None)
    assert too_small is not None and "/dev/shm has 463 MiB free" in too_small and "64 MiB" in too_small
    limited = shared_memory.room_refusal(slots, 10_000 * MIB, 799 * MIB)
    assert limited is not None and "memory limit (cgroup) leaves 799 MiB" in limited, limited
    assert "400 MiB" in limited and "--memory" in limited
    # small slots still leave the 64 MiB margin
    assert shared_memory.room_refusal(MIB, 10_000 * MIB, 64 * MIB) is not None
    assert shared_memory.room_refusal(MIB, 10_000 * MIB, 65 * MIB) is None


def _cgroup_tree(root: Path, files: dict[str, str], self_cgroup: str) -> tuple[str, str]:
    for relative, text in files.items():
        path = root / "sys" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = root / "self_cgroup"
    proc.write_text(self_cgroup)
    return str(root / "sys"), str(proc)


def test_cgroup_v2_room_is_the_tightest_limit_above_the_process(tmp_path: Path) -> None:
    sys_root, proc = _cgroup_tree(
        tmp_path,
        {
            "job/memory.max": "8000",
            "job/memory.current": "3000",
            "job/memory.stat": "anon 2000\ninactive_file 500\nactive_file 500\n",
            "job/rank/memory.max": "max",
            "job/rank/memory.current": "2500",
        },
        "0::/job/rank\n",
    )
    assert cgroup_memory_room(sys_root, proc) == 8000 - (3000 - 500)  # inactive page cache counts as free


def test_cgroup_v2_in_a_container_namespace(tmp_path: Path) -> None:
    # Docker with a cgroup namespace: the container's own cgroup is the root of the mount
    sys_root, proc = _cgroup_tree(tmp_path, {"memory.max": "4096", "memory.current": "1024"}, "0::/\n")
    assert cgroup_memory_room(sys_root, proc) == 3072


def test_cgroup_v1_with_the_hosts_path_not_mounted(tmp_path: Path) -> None:
    # Docker on cgroup v1: /proc/self/cgroup names the host's path; the container sees its own at the top
    sys_root, proc = _cgroup_tree(
        tmp_path,
        {
            "memory/memory.limit_in_bytes": "10000",
            "memory/memory.usage_in_bytes": "6000",
            "memory/memory.stat": "cache 1000\ntotal_inactive_file 1000\ninactive_file 7\n",
        },
        "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n",
    )
    assert cgroup_memory_room(sys_root, proc) == 10000 - (6000 - 1000)


def test_cgroup_without_a_limit_or_without_files(tmp_path: Path) -> None:
    sys_root, proc = _cgroup_tree(
        tmp_path,
        {
            "memory/a/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
            "memory/a/memory.usage_in_bytes": "6000",
            "a/memory.max": "max",
            "a/memory.current": "6000",
        },
        "4:memory:/a\n0::/a\n",
    )
    assert cgroup_memory_room(sys_root, proc) is None
    assert cgroup_memory_room(str(tmp_path / "nothing"), str(tmp_path / "no_self_cgroup")) is None


def test_obstacles_name_the_rank_and_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPX_SHARED_MEMORY", "0")
    off = shared_memory.local_obstacles(params_on_cpu=True)
    monkeypatch.setenv("DDPX_SHARED_MEMORY", "1")
    assert shared_memory.local_obstacles(params_on_cpu=True) == 0
    on_gpu = shared_memory.local_obstacles(params_on_cpu=False)
    assert shared_memory.obstacles_refusal([0, 0], 0) is None
    assert shared_memory.obstacles_refusal([0, off], 0) == "DDPX_SHARED_MEMORY=0 in rank 1's environment"
    assert shared_memory.obstacles_refusal([0, off], 1) == "DDPX_SHARED_MEMORY=0 in this rank's environment"
    assert shared_memory.obstacles_refusal([on_gpu, 0], 1) == "rank 0's parameters are not on the CPU"
    both = shared_memory.obstacles_refusal([shared_memory.NOT_LINUX, off], 0)
    assert (
        both == "no /dev/shm on this rank's machine (not Linux); DDPX_SHARED_MEMORY=0 in rank 1's environment"
    )


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
    if rank == 1 and how == "another_machine":  # the descriptor rank 0 announces is another file here
        real_open = shared_memory._open_rank0_file
        shared_memory._open_rank0_file = lambda pid, fd, token, total: real_open(os.getpid(), 0, token, total)
    model = lightning_ddpx.DistributedDataParallel(mlp())
    result = train_side_by_side(rank, mlp, mlp_loss, 4, rtol=0, atol=0)
    return {
        **result,
        "refusal": model.reducer.shared_memory_refusal,
        "files_left": _our_files() if rank == 0 else [],
    }


@pytest.mark.parametrize("how", ["switched_off", "another_machine"])
@pytest.mark.processes
def test_every_rank_falls_back_to_gloo_when_one_cannot_take_part(how: str) -> None:
    results = run_distributed(run_refusal, 2, how)
    assert [result["path"] for result in results] == ["whole", "whole"]
    assert results[0]["files_left"] == []
    refusals = [result["refusal"] for result in results]  # each rank says why, naming the cause on rank 1
    if how == "switched_off":  # known from the model check: both name it
        assert refusals == ["DDPX_SHARED_MEMORY=0 in rank 1's environment"] + [
            "DDPX_SHARED_MEMORY=0 in this rank's environment"
        ], refusals
    else:
        assert "could not map" in refusals[0], refusals
        assert "different machines" in refusals[1], refusals


def run_construction(rank: int, world_size: int) -> dict:
    model = lightning_ddpx.DistributedDataParallel(mlp())
    return {
        "path": default_path(model),
        "refusal": model.reducer.shared_memory_refusal,
        "files_left": _our_files() if rank == 0 else [],
    }


@pytest.mark.processes
def test_the_shared_file_is_gone_once_every_rank_mapped_it() -> None:
    results = run_distributed(run_construction, 2)
    assert [result["path"] for result in results] == ["shared_memory"] * 2
    assert [result["refusal"] for result in results] == [None, None]
    assert results[0]["files_left"] == []


@pytest.mark.processes
def test_three_ranks_say_why_they_use_gloo() -> None:
    for result in run_distributed(run_construction, 3):
        assert result["path"] == "whole" and "3 ranks" in result["refusal"], result


# Every function of torch.distributed that communicates and that lightning_ddpx calls, or could
_DIST_FUNCTIONS = (
    "all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter_tensor", "scatter",
    "all_to_all", "send", "recv", "isend", "irecv",
)  # fmt: skip


def _record_collectives() -> list[str]:
    """From now on in this process, the name of every torch.distributed call issued from outside
    torch.distributed (``broadcast_object_list`` counts once, not with the broadcasts inside it)."""
    calls: list[str] = []
    depth = [0]
    c10d = dist.distributed_c10d
    for name in _DIST_FUNCTIONS:
        original = getattr(c10d, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            if depth[0] == 0:
                calls.append(_name)
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(c10d, name, recorded)
        setattr(dist, name, recorded)
    return calls


def run_counted_construction(rank: int, world_size: int, wanted: list[bool], init_sync: bool) -> dict:
    set_shared_memory(wanted[rank])
    calls = _record_collectives()
    model = lightning_ddpx.DistributedDataParallel(mlp(), init_sync=init_sync)
    issued = list(calls)
    mlp_loss(model, 0).backward()  # its first reduction: a path left undecided is chosen by then
    train_side_by_side(rank, mlp, mlp_loss, 2, rtol=0, atol=0)  # still in step with the other rank
    return {"calls": issued, "path": default_path(model), "refusal": model.reducer.shared_memory_refusal}


# What construction issued before shared memory existed: the model check, then rank 0's weights (one
# float32 tensor group); and what mapping the slots adds
BEFORE_SHARED_MEMORY = ["all_gather", "broadcast"]
SET_UP = ["broadcast_object_list", "all_reduce"]


@pytest.mark.parametrize(
    "wanted, expected_calls, expected_path",
    [
        ([False, False], BEFORE_SHARED_MEMORY, "whole"),
        ([True, False], BEFORE_SHARED_MEMORY, "whole"),
        ([False, True], BEFORE_SHARED_MEMORY, "whole"),
        ([True, True], BEFORE_SHARED_MEMORY + SET_UP, "shared_memory"),
    ],
    ids=["off", "off_on_rank_1", "off_on_rank_0", "on"],
)
@pytest.mark.processes
def test_switched_off_costs_no_collective_and_disagreement_falls_back(
    wanted: list[bool], expected_calls: list[str], expected_path: str
) -> None:
    """Whether each rank wants shared memory travels on the model check's all-gather: switched off on
    every rank, construction issues exactly what it did before shared memory existed; switched off on one
    rank, both ranks know it from that check, neither starts the set-up, and they train in step on gloo."""
    results = run_distributed(run_counted_construction, 2, wanted, True)
    for rank, result in enumerate(results):
        assert result["calls"] == expected_calls, (rank, result)
        assert result["path"] == expected_path, (rank, result)
        if not all(wanted):
            assert "DDPX_SHARED_MEMORY=0 in" in result["refusal"], result


@pytest.mark.parametrize(
    "wanted, expected_path",
    [([False, True], "whole"), ([True, True], "shared_memory")],
    ids=["off_on_rank_0", "on"],
)
@pytest.mark.processes
def test_without_the_model_check_construction_issues_nothing_and_the_settings_check_asks(
    wanted: list[bool], expected_path: str
) -> None:
    """``init_sync=False`` skips the model check: construction issues no collective at all (as torch's DDP),
    so a rank building its module cannot meet a collective the other rank runs meanwhile (a fault-tolerant
    newcomer receiving its state). Whether every rank wants shared memory then travels on the settings check
    before the first reduction, and the path is chosen there, alike on both ranks."""
    results = run_distributed(run_counted_construction, 2, wanted, False)
    assert [result["calls"] for result in results] == [[]] * 2, results
    assert [result["path"] for result in results] == [expected_path] * 2, results


@pytest.mark.slow
@pytest.mark.parametrize(
    "victim, mode",
    [(1, "tmpfile"), (1, "named"), (0, "tmpfile")],
    ids=["rank_1_killed", "rank_1_killed_named_file", "rank_0_killed"],
)
@pytest.mark.processes
def test_a_rank_killed_during_set_up_leaves_nothing_in_dev_shm(victim: int, mode: str) -> None:
    """SIGKILL after rank 0 created the shared file and before both mapped it (``named``: on a file system
    without O_TMPFILE, where the file briefly has a name): no file of either rank's is left in /dev/shm, and
    the survivor raises our named error at once, not gloo's bare message and not after a hang."""
    port = str(free_port())
    envs = [job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2") for r in (0, 1)]
    command = [sys.executable, "-m", "tests.jobs.shm_peer_death_job", str(victim), mode]
    jobs = run_jobs([(command, env) for env in envs], timeout=90)
    assert jobs[victim].returncode == -signal.SIGKILL, (jobs[victim].returncode, jobs[victim].stderr[-3000:])
    pids = [int(job.stdout.splitlines()[0].split()[1]) for job in jobs]
    left = [
        name for name in os.listdir("/dev/shm") if any(name.startswith(f"lightning_ddpx_{p}_") for p in pids)
    ]
    assert left == []
    survivor = 1 - victim
    assert jobs[survivor].returncode == 0, jobs[survivor].stderr[-3000:]
    outcome = json.loads(jobs[survivor].stdout.splitlines()[-1])
    assert outcome["type"] == "CommunicationError", outcome
    message = outcome["message"]
    assert message.startswith(f"lightning_ddpx (rank {survivor})"), message
    assert "while waiting for the other rank to map the shared-memory slots" in message, message
    assert f"the other rank (rank {victim}) exited or crashed" in message, message


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


@pytest.mark.processes
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
@pytest.mark.processes
def test_other_dtypes_sum_bit_identically_to_torch(dtype_name: str) -> None:
    results = run_distributed(run_dtype, 2, dtype_name)
    assert [result["path"] for result in results] == ["shared_memory"] * 2
