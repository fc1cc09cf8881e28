"""Run a test function on N gloo processes over 127.0.0.1, with a free port and a hard timeout.

Processes are forked from a forkserver that has already imported torch, so each test pays for process
start-up but not for importing torch again. A failing rank's traceback is raised in the test; a rank that
hangs fails the test after ``timeout`` seconds instead of stalling CI.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from lightning_ddpx.bench.launch import free_port

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(
    ["torch", "torch.distributed", "lightning", "lightning_ddpx"]
)  # lightning: most tests train with it
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    pg_timeout_s: float,
    init_process_group: bool,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    try:
        if init_process_group:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", _to_bytes(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if init_process_group and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    init_process_group: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and return each rank's result.

    ``fn`` must be importable (defined at module level). Results travel through ``torch.save``, so
    tensors, dicts and lists of them are fine. Raises ``AssertionError`` carrying the first failing rank's
    traceback, or a ``TimeoutError`` naming the ranks that did not finish within ``timeout`` seconds.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    pythonpath = os.environ.get("PYTHONPATH", "")
    if _REPO_ROOT not in pythonpath.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, pythonpath) if p)
    port = free_port()
    results = _CONTEXT.Queue()
    processes = [
        _CONTEXT.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, results, pg_timeout, init_process_group),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                    f"(finished: {sorted(outcomes)}); errors so far: "
                    + "; ".join(f"rank {r}: {o[1]}" for r, o in outcomes.items() if o[0] == "error")
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in outcomes
                ]
                if dead:
                    raise AssertionError(
                        f"rank(s) {dead} exited with code(s) {[processes[r].exitcode for r in dead]} "
                        "without reporting a result"
                    ) from None
                continue
            outcomes[rank] = (status, payload)
            if status == "error":
                # One rank failed: the others may now wait forever on a collective. Give them a moment
                # to report their own errors (usually consequences of the first), then stop.
                _collect_more(results, outcomes, world_size, grace=3.0)
                others = [r for r, o in outcomes.items() if o[0] == "error" and r != rank]
                details = "".join(f"\n--- rank {r} (failed later) ---\n{outcomes[r][1]}" for r in others)
                raise AssertionError(f"rank {rank} failed first:\n{payload}{details}")
    finally:
        for process in processes:
            process.join(timeout=5 if len(outcomes) == world_size else 0.1)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    return [_from_bytes(outcomes[rank][1]) for rank in range(world_size)]


def _collect_more(results: Any, outcomes: dict, world_size: int, grace: float) -> None:
    deadline = time.monotonic() + grace
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            return
        outcomes[rank] = (status, payload)
