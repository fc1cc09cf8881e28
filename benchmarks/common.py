"""Shared parts of the lightning-ddpx benchmarks: models and their targets, the launcher, timing, verdicts.

Why these pieces exist:

- The CPU machines these benchmarks run on are shared and noisy (step times drift by 15-30 % between runs),
  so an absolute millisecond figure says little. Every benchmark therefore runs all contenders in the *same*
  processes, interleaved in short blocks, and reports the ratio of step times that were measured close
  together in time (:func:`interleaved_timing`, :func:`summarize_pair`).
- The engine benchmark and the hook-by-hook benchmark must measure the same models the same way, so the
  launcher (:func:`launch`) lives here, and the model zoo (:data:`MODELS`) and the timing statistics come
  from ``lightning_ddpx.bench`` (the benchmark users run on their own models uses them too).
- What counts as fast enough is ours to judge, not the user CLI's: the targets (:data:`TARGET_RATIOS`) and
  the verdict (:func:`verdict`) live here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import queue
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddpx.bench.launch import free_port
from lightning_ddpx.bench.models import MODELS, ModelSpec, build_model
from lightning_ddpx.bench.timing import (
    PairSummary,
    format_table,
    interleaved_timing,
    percentile,
    summarize_pair,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = [
    "MODELS",
    "REPO_ROOT",
    "TARGET_RATIOS",
    "ModelSpec",
    "PairSummary",
    "build_model",
    "environment_info",
    "format_table",
    "free_port",
    "interleaved_timing",
    "launch",
    "make_batch",
    "make_train_step",
    "max_param_diff",
    "parameter_summary",
    "percentile",
    "summarize_pair",
    "verdict",
]


# ------------------------------------------------------------------------------------------------- models
def make_batch(name: str, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed (input, target) batch for ``rank``: different per rank like real data parallelism, but made
    once, so data generation is not part of the timed step."""
    spec = MODELS[name]
    generator = torch.Generator().manual_seed(1_000_003 * seed + rank)
    return torch.randn(spec.input_shape, generator=generator), torch.randn(
        spec.target_shape, generator=generator
    )


def make_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> Callable[[], None]:
    """The timed unit: zero_grad, forward, MSE loss, backward (which synchronises), optimizer step."""
    inputs, target = batch

    def step() -> None:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        optimizer.step()

    return step


def parameter_summary(module: nn.Module) -> tuple[int, int]:
    """(number of parameter tensors, number of scalar parameters)."""
    params = list(module.parameters())
    return len(params), sum(p.numel() for p in params)


@torch.no_grad()
def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between corresponding parameters of two copies of one architecture."""
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


# ----------------------------------------------------------------------------------------------- launcher
def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    pg_timeout_s: float,
) -> None:
    # One intra-op thread per process: two processes on a small CPU machine must not oversubscribe cores,
    # or the measurement becomes a measurement of the OS scheduler. (OMP_NUM_THREADS is set by the parent.)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    world_size: int = 2,
    timeout_s: float = 1800.0,
    pg_timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU processes joined by gloo on 127.0.0.1.

    ``fn`` must be importable (module level) and return something picklable. Spawn (not fork) gives each rank
    a clean interpreter, as a real launcher would. Returns the results by rank; raises ``RuntimeError`` with
    the first failing rank's traceback, or ``TimeoutError`` if the job takes longer than ``timeout_s``.
    """
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned children before torch loads OpenMP
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
    context = mp.get_context("spawn")
    port = free_port()
    results = context.Queue()
    processes = [
        context.Process(
            target=_rank_main, args=(rank, world_size, port, fn, args, results, pg_timeout_s), daemon=True
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(f"benchmark ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in outcomes
                ]
                if dead:
                    raise RuntimeError(f"benchmark rank(s) {dead} died without reporting a result") from None
                continue
            outcomes[rank] = (status, payload)
            if status == "error":
                raise RuntimeError(f"benchmark rank {rank} failed:\n{payload}")
    finally:
        for process in processes:
            process.join(timeout=10 if len(outcomes) == world_size else 0.5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    return [outcomes[rank][1] for rank in range(world_size)]


# --------------------------------------------------------------------------------------------- statistics
# The largest acceptable step-time ratio ours/torch DDP per model (bench_engine's targets; bench_hooks and
# bench_stats judge only the models listed here). ``tiny`` has none: it only exercises the scripts.
TARGET_RATIOS: dict[str, float] = {"mlp": 1.00, "transformer": 1.00, "many": 1.00, "many1000": 1.00}


def verdict(ratio: float, target: float | None) -> str:
    """PASS when the ratio meets the target, MISS otherwise, '-' when the model has no target."""
    if target is None:
        return "-"
    return "PASS" if ratio <= target else "MISS"


# ------------------------------------------------------------------------------------------------ reporting
def environment_info() -> dict[str, Any]:
    """What a reader needs to judge a result: versions, CPU count, load, and the git commit measured."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg": load,
        "git_commit": commit or None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
