"""Start the benchmark's ranks: processes on this machine over loopback, or one per network namespace.

Over loopback, communication runs at memory speed, which hides what compression buys on a real network.
With ``link="1gbit"`` (2 ranks) each rank runs in its own Linux network namespace, joined by a veth pair
shaped with ``tc`` (:mod:`lightning_ddpx.bench.netns`), so the two "nodes" talk over a link of known bandwidth
(``link="unlimited"``: the namespaces without shaping).

A worker is a module run as ``python -m worker CONFIG RANK``: it reads the JSON ``CONFIG``, finds
``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK`` in its environment, and hands its result back with
:func:`write_result`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from typing import Any, Iterator

from lightning_ddpx.bench.cleanup import exits_through_python, temporary_directory

__all__ = ["free_port", "run_ranks", "write_result"]


def run_ranks(
    config: dict[str, Any], link: str | None, timeout_s: float, worker: str = "lightning_ddpx.bench.worker"
) -> list[dict[str, Any]]:
    """Run the module ``worker`` (``python -m worker CONFIG RANK``) on ``config['world_size']`` ranks; their
    results (each rank's ``rank<N>.json``), by rank.

    Rank 0's output (progress) goes to this terminal; a failing rank's stderr is raised in the error.
    Stopped by SIGTERM, SIGHUP or Ctrl-C, it stops the ranks and deletes its directory and network namespaces
    first (:mod:`lightning_ddpx.bench.cleanup`).
    """
    with exits_through_python(), temporary_directory("ddpx-bench") as directory:
        os.chmod(directory, 0o755)
        config_path = os.path.join(directory, "config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        with _network(link, config["world_size"]) as network:
            processes = _start(config_path, config["world_size"], network, directory, worker)
            _wait(processes, timeout_s, directory)
        results = []
        for rank in range(config["world_size"]):
            with open(os.path.join(directory, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


@contextlib.contextmanager
def _network(link: str | None, world_size: int) -> Iterator[Any]:
    if link is None:
        yield None
        return
    from lightning_ddpx.bench.netns import VethLink, netns_unavailable_reason

    if world_size != 2:
        raise ValueError(f"--link emulates two nodes: it needs --world-size 2, got {world_size}")
    reason = netns_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"--link {link}: network namespaces are not available here ({reason})")
    with VethLink(rate=None if link == "unlimited" else link) as veth:
        yield veth


def _start(
    config_path: str, world_size: int, network: Any, directory: str, worker: str
) -> list[subprocess.Popen]:
    port = random.randint(20000, 60000) if network is not None else free_port()
    base = dict(os.environ)
    base.update(
        OMP_NUM_THREADS="1",
        WORLD_SIZE=str(world_size),
        MASTER_PORT=str(port),
        PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), base.get("PYTHONPATH", "")) if p),
    )
    processes = []
    for rank in range(world_size):
        env = dict(base, RANK=str(rank))
        argv = [sys.executable, "-m", worker, config_path, str(rank)]
        if network is None:
            env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
        else:
            env.update(network.env(rank))
            argv = network.command(rank, argv)
        stderr = open(os.path.join(directory, f"rank{rank}.err"), "w")
        stdout = None if rank == 0 else subprocess.DEVNULL
        processes.append(subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr))
        stderr.close()
    return processes


def _wait(processes: list[subprocess.Popen], timeout_s: float, directory: str) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in processes):
            failed = [r for r, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(_failure(failed[0], processes[failed[0]].returncode, directory))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the benchmark did not finish within {timeout_s:.0f} s (raise --timeout)")
            time.sleep(0.2)
        failed = [r for r, p in enumerate(processes) if p.returncode != 0]
        if failed:
            raise RuntimeError(_failure(failed[0], processes[failed[0]].returncode, directory))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def _failure(rank: int, code: int | None, directory: str) -> str:
    with open(os.path.join(directory, f"rank{rank}.err")) as f:
        tail = f.read()[-4000:]
    return f"benchmark rank {rank} exited with code {code}:\n{tail}"


def write_result(config_path: str, rank: int, result: Any) -> None:
    """A worker's JSON-able ``result``, where :func:`run_ranks` reads it (written atomically)."""
    out = os.path.join(os.path.dirname(config_path), f"rank{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
