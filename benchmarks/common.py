"""Shared parts of the lightning-ddpx benchmarks: models, 2-process gloo launcher, interleaved timing, ratios.

Why these pieces exist:

- The CPU machines these benchmarks run on are shared and noisy (step times drift by 15-30 % between runs),
  so an absolute millisecond figure says little. Every benchmark therefore runs all contenders in the *same*
  processes, interleaved in short blocks, and reports the ratio of step times that were measured close
  together in time (:func:`interleaved_timing`, :func:`summarize_pair`).
- The engine benchmark and the hook-by-hook benchmark must measure the same models the same way, so the model
  zoo (:data:`MODELS`), the launcher (:func:`launch`) and the statistics live here.

Nothing in this module depends on lightning_ddpx; it only needs torch.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import platform
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = [
    "MODELS",
    "REPO_ROOT",
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
class MLP(nn.Sequential):
    """Wide fully connected layers: few, large gradient tensors, so step time is dominated by bandwidth
    (the allreduce of ~80 MB) and by how well communication overlaps the backward pass."""

    def __init__(self, width: int = 2048, layers: int = 5) -> None:
        modules: list[nn.Module] = []
        for i in range(layers):
            modules.append(nn.Linear(width, width))
            if i < layers - 1:
                modules.append(nn.ReLU())
        super().__init__(*modules)


class Encoder(nn.Module):
    """A small ``nn.TransformerEncoder``: a realistic mix of matrix and vector parameters (48 tensors).

    Dropout is 0 so that the run is deterministic: both contenders do bit-identical arithmetic, and the
    benchmark can check that their parameters still agree at the end (proof that they did the same work).
    """

    def __init__(self, d_model: int = 256, nhead: int = 8, num_layers: int = 4, dim_feedforward: int = 1024):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


class ManySmall(nn.Module):
    """Many small residual layers: ~300 parameter tensors of ~13k elements each (~2M parameters).

    Per-parameter bookkeeping dominates here, not arithmetic or bandwidth, which is exactly where a Python
    reducer pays for itself (a hook call per gradient, per-bucket Python work) - so it is the stress test.
    """

    def __init__(self, width: int = 116, depth: int = 150) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class Tiny(nn.Module):
    """A few-parameter model for smoke tests of the benchmark scripts themselves (no target)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: how to build it, what one rank's batch looks like, and the ratio target.

    ``target_ratio`` is the largest acceptable step-time ratio ours/torch (None: no target, e.g. tiny).
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    target_ratio: float | None


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "mlp",
            "MLP 5 x Linear(2048, 2048), ~21M params in 10 tensors, batch 32",
            MLP,
            (32, 2048),
            (32, 2048),
            1.00,
        ),
        ModelSpec(
            "transformer",
            "TransformerEncoder 4 layers, d_model 256, 8 heads, ff 1024, seq 128, batch 8",
            Encoder,
            (8, 128, 256),
            (8, 128, 256),
            1.00,
        ),
        ModelSpec(
            "many",
            "150 residual Linear(116, 116), ~2M params in 300 tensors, batch 32",
            ManySmall,
            (32, 116),
            (32, 116),
            1.05,
        ),
        ModelSpec("tiny", "Linear(8, 16) + Linear(16, 4), smoke tests only", Tiny, (4, 8), (4, 4), None),
    )
}


def build_model(name: str, seed: int = 0) -> nn.Module:
    """A fresh copy of model ``name``; the same ``seed`` gives bit-identical weights (on every rank too)."""
    torch.manual_seed(seed)
    return MODELS[name].build()


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
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


# ------------------------------------------------------------------------------------------------- timing
def interleaved_timing(
    steps: Mapping[str, Callable[[], None]],
    timed_steps: int,
    warmup_steps: int,
    block: int,
    on_block: Callable[[int, int, dict[str, list[float]]], None] | None = None,
    after_step: Mapping[str, Callable[[], None]] | None = None,
) -> dict[str, list[float]]:
    """Time each contender's step ``timed_steps`` times, alternating contenders in blocks of ``block`` steps.

    Why interleave: on a shared machine the speed of the CPU changes over seconds (other jobs, frequency,
    thermal). Timing all of A and then all of B turns that drift into a fake A/B difference; alternating short
    blocks exposes both to the same conditions. The order inside a round is reversed every other round
    (A B, B A, A B, ...) so neither contender always runs right after the other one (cold caches, a
    collective still draining). Every contender first runs ``warmup_steps`` untimed steps (round-robin), which
    must cover lazy initialisation such as DDP's bucket rebuild after the first iteration.

    Returns seconds per timed step, by contender; entry ``i`` of every list belongs to the same round, so
    ``a[i] / b[i]`` compares steps measured close together. ``on_block(round, rounds, times_of_round)`` is
    called after each round (for live progress), ``after_step[name]()`` after each timed step (diagnostics).
    """
    if timed_steps < 1 or block < 1 or warmup_steps < 0:
        raise ValueError(
            f"need timed_steps >= 1, block >= 1, warmup_steps >= 0; got {timed_steps}, {block}, "
            f"{warmup_steps}"
        )
    names = list(steps)
    for _ in range(warmup_steps):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    rounds = math.ceil(timed_steps / block)
    clock = time.perf_counter
    for r in range(rounds):
        count = min(block, timed_steps - r * block)
        this_round: dict[str, list[float]] = {}
        for name in names if r % 2 == 0 else reversed(names):
            step, hook = steps[name], (after_step or {}).get(name)
            samples = []
            for _ in range(count):
                started = clock()
                step()
                samples.append(clock() - started)
                if hook is not None:
                    hook()
            this_round[name] = samples
            times[name].extend(samples)
        if on_block is not None:
            on_block(r, rounds, {name: this_round[name] for name in names})
    return times


# --------------------------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class PairSummary:
    """Step times of a baseline and a candidate measured interleaved, and their ratio candidate/baseline.

    ``ratio`` (the headline) is the median of per-pair ratios ``candidate[i] / baseline[i]``: each pair was
    measured in the same round, so slow phases of the machine cancel out in the pair instead of moving one
    side's median. ``ratio_p25``/``ratio_p75`` show the spread; ``ratio_of_medians`` is a cross-check.
    """

    baseline_ms: float  # median
    candidate_ms: float  # median
    baseline_p25_ms: float
    baseline_p75_ms: float
    candidate_p25_ms: float
    candidate_p75_ms: float
    ratio: float
    ratio_p25: float
    ratio_p75: float
    ratio_of_medians: float
    pairs: int


def summarize_pair(baseline_s: Sequence[float], candidate_s: Sequence[float]) -> PairSummary:
    """Summarise equal-length, round-aligned step times in seconds (from :func:`interleaved_timing`)."""
    if len(baseline_s) != len(candidate_s) or not baseline_s:
        raise ValueError(
            f"need two equally long non-empty lists, got {len(baseline_s)} and {len(candidate_s)}"
        )
    ratios = [c / b for b, c in zip(baseline_s, candidate_s)]
    base = [1e3 * t for t in baseline_s]
    cand = [1e3 * t for t in candidate_s]
    return PairSummary(
        baseline_ms=percentile(base, 50),
        candidate_ms=percentile(cand, 50),
        baseline_p25_ms=percentile(base, 25),
        baseline_p75_ms=percentile(base, 75),
        candidate_p25_ms=percentile(cand, 25),
        candidate_p75_ms=percentile(cand, 75),
        ratio=percentile(ratios, 50),
        ratio_p25=percentile(ratios, 25),
        ratio_p75=percentile(ratios, 75),
        ratio_of_medians=percentile(cand, 50) / percentile(base, 50),
        pairs=len(ratios),
    )


def verdict(ratio: float, target: float | None) -> str:
    """PASS when the ratio meets the target, MISS otherwise, '-' when the model has no target."""
    if target is None:
        return "-"
    return "PASS" if ratio <= target else "MISS"


# ------------------------------------------------------------------------------------------------ reporting
def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns (first column left-aligned), for terminals and logs."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


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
