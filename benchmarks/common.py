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

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from benchmarks import rank_worker
from lightning_ddpx.bench.launch import free_port, run_ranks
from lightning_ddpx.bench.models import MODELS, ModelSpec, build_model
from lightning_ddpx.bench.timing import (
    PairSummary,
    RatioInterval,
    format_table,
    interleaved_timing,
    percentile,
    ratio_interval,
    summarize_pair,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = [
    "MODELS",
    "REPO_ROOT",
    "TARGET_RATIOS",
    "ModelSpec",
    "PairSummary",
    "RatioInterval",
    "build_model",
    "environment_info",
    "format_table",
    "free_port",
    "interleaved_timing",
    "launch",
    "make_batch",
    "make_train_step",
    "max_param_diff",
    "model_names",
    "parameter_summary",
    "percentile",
    "ratio_interval",
    "summarize_pair",
    "verdict",
    "write_json",
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
def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    world_size: int = 2,
    timeout_s: float = 1800.0,
    pg_timeout_s: float = 300.0,
    link: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU processes joined by gloo; results by rank.

    The ranks are started by the shipped launcher, ``lightning_ddpx.bench.launch.run_ranks`` (fresh
    interpreters, as a real launcher would; over loopback, or with ``link="1gbit"``... over an emulated link
    between two network namespaces), each running ``benchmarks.rank_worker``. ``fn`` must be defined at module
    level (in a benchmark script run as ``python benchmarks/x.py`` too) and return something picklable.
    Raises ``RuntimeError`` with the first failing rank's stderr, or ``TimeoutError`` after ``timeout_s``.
    """
    function = _importable_name(fn)
    config = {
        "world_size": world_size,
        "function": function,
        "args": rank_worker.encode(tuple(args)),
        "pg_timeout_s": pg_timeout_s,
        # classes defined in a script run as __main__ are pickled under that name: the rank must find them
        "main_module": function.partition(":")[0] if fn.__module__ == "__main__" else None,
    }
    pythonpath = os.environ.get("PYTHONPATH", "")
    if REPO_ROOT not in pythonpath.split(os.pathsep):  # the ranks import `benchmarks` from the repo
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, pythonpath) if p)
    results = run_ranks(config, link, timeout_s, worker="benchmarks.rank_worker")
    return [rank_worker.decode(result["pickle"]) for result in results]


def _importable_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of ``fn``; a script's ``__main__`` becomes its module path under the repo."""
    module = fn.__module__
    if module == "__main__":
        path = os.path.abspath(sys.modules["__main__"].__file__ or "")
        module = os.path.splitext(os.path.relpath(path, REPO_ROOT))[0].replace(os.sep, ".")
    return f"{module}:{fn.__qualname__}"


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
    """What a reader needs to judge and repeat a result: the command, versions, CPU count, load, the date and
    the git commit measured."""
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
        "command": _command(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg": load,
        "git_commit": commit or None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),  # malloc settings change CPU-side step times
    }


def _command() -> str:
    """The command line that started this process, as a reader would type it to measure again: the script's
    path relative to the repository (``python benchmarks/bench_engine.py --models mlp``)."""
    script = sys.argv[0] if sys.argv and sys.argv[0] else "-c"
    if os.path.isfile(script):
        script = os.path.relpath(os.path.abspath(script), REPO_ROOT)
    return " ".join(["python", script, *sys.argv[1:]])


def model_names(parser: argparse.ArgumentParser, given: str | Iterable[str]) -> list[str]:
    """The names ``--models`` gives (comma-separated, in one string or several), each checked against
    :data:`MODELS`: an unknown one, or none at all, stops the benchmark with the list of known ones."""
    groups = [given] if isinstance(given, str) else list(given)
    names = [m.strip() for group in groups for m in group.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        what = f"unknown model(s) {unknown}" if unknown else "no model given"
        parser.error(f"{what}; choose from {', '.join(MODELS)}")
    return names


def write_json(path: str | None, results: dict[str, Any]) -> None:
    """Write a benchmark's results to ``path`` (``--json``; nothing when not given), creating its folder."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
