"""The tests' one place for starting processes: functions on N gloo ranks, and real jobs (scripts, CLIs).

- :func:`run_distributed` runs a test function on N gloo processes over 127.0.0.1, with a free port and a
  hard timeout. Processes are forked from a forkserver that has already imported torch, so each test pays
  for process start-up but not for importing torch again. A failing rank's traceback is raised in the
  test; a rank that hangs fails the test after ``timeout`` seconds instead of stalling CI.
- :func:`run_jobs` / :func:`run_job` start real commands (``python -m lightning_ddpx.bench``, torchrun, a
  benchmark script, N ranks of a job script) with :func:`job_env`, wait for them together under one hard
  timeout, and return each one's return code, stdout and stderr. On timeout every process *group* is
  killed, so what a launcher started dies with it.

Test plumbing lives here, not in the package: the benchmark CLI (``lightning_ddpx.bench.launch``) has its
own launcher for its users, and the tests do not depend on it.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(
    ["torch", "torch.distributed", "lightning", "lightning_ddpx"]
)  # lightning: most tests train with it
REPO_ROOT = Path(__file__).resolve().parents[1]
_REPO_ROOT = str(REPO_ROOT)
# What a launcher, a scheduler or an enclosing job may have set: a job a test starts must not inherit it.
_LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_JOB_ID", "SLURM_NTASKS",
)  # fmt: skip


# Lightning's advice for real training that does not apply to tiny CPU tests.
LIGHTNING_ADVICE = (
    ".*does not have many workers.*",
    ".*log_every_n_steps.*",
    ".*GPU available but not used.*",
    ".*`isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
)


def quiet() -> None:
    """Hide :data:`LIGHTNING_ADVICE` in this process and the processes it starts; a rank process calls it
    (the test process gets it from ``tests/conftest.py``)."""
    for message in LIGHTNING_ADVICE:
        warnings.filterwarnings("ignore", message=message)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo group of world size 1 in this process (about 20 ms), destroyed afterwards: for the checks that
    need a process group but not a second rank."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
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
    os.environ["PYTHONPATH"] = _with_repo_root(os.environ.get("PYTHONPATH", ""))
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


def _with_repo_root(pythonpath: str) -> str:
    if _REPO_ROOT in pythonpath.split(os.pathsep):
        return pythonpath
    return os.pathsep.join(p for p in (_REPO_ROOT, pythonpath) if p)


# ---------------------------------------------------------------------------------------------- real jobs
def job_env(**overrides: str) -> dict[str, str]:
    """The environment of a job a test starts: this one without launcher variables (``RANK``, ``MASTER_PORT``,
    SLURM's, ...), one OpenMP thread per process, the repository importable; then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=_with_repo_root(env.get("PYTHONPATH", "")))
    env.update(overrides)
    return env


def run_job(
    argv: Sequence[str], timeout: float, env: dict[str, str] | None = None, cwd: str | os.PathLike = REPO_ROOT
) -> subprocess.CompletedProcess:
    """Run one command (:func:`run_jobs` with one entry); ``env`` defaults to :func:`job_env`."""
    return run_jobs([(argv, env if env is not None else job_env())], timeout, cwd)[0]


def run_jobs(
    commands: Sequence[tuple[Sequence[str], dict[str, str]]],
    timeout: float,
    cwd: str | os.PathLike = REPO_ROOT,
) -> list[subprocess.CompletedProcess]:
    """Start every ``(argv, env)`` at once (the ranks of one job), wait for all of them together, and return
    each one's return code, stdout and stderr, in order.

    Output goes to files, not pipes, so a chatty rank cannot block on a full pipe while another waits for
    it in a collective. Each command runs in its own session: if the job is not done after ``timeout``
    seconds, its process groups are SIGKILLed (children a launcher started included) and ``TimeoutError``
    says which commands were still running, with the tail of their output.
    """
    with tempfile.TemporaryDirectory(prefix="ddpx-test-job-") as directory:
        processes, outputs = [], []
        try:
            for i, (argv, env) in enumerate(commands):
                stdout_path, stderr_path = (os.path.join(directory, f"{i}.{n}") for n in ("out", "err"))
                outputs.append((stdout_path, stderr_path))
                with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
                    processes.append(
                        subprocess.Popen(
                            list(argv), cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True
                        )
                    )
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
                time.sleep(0.05)
            running = [i for i, p in enumerate(processes) if p.poll() is None]
        finally:
            for process in processes:
                _kill_group(process)
        results = [
            subprocess.CompletedProcess(list(argv), p.returncode, _read(out), _read(err))
            for (argv, _), p, (out, err) in zip(commands, processes, outputs)
        ]
    if running:
        raise TimeoutError(
            f"still running after {timeout:.0f} s, killed: "
            + "".join(
                f"\n--- {' '.join(results[i].args)}\n{results[i].stdout[-2000:]}{results[i].stderr[-3000:]}"
                for i in running
            )
        )
    return results


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL what is left of ``process``'s session (itself, or children it started that outlived it)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait(timeout=30)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
