"""Timing on a noisy shared machine: interleave contenders in short blocks and compare same-round pairs.

Why: the CPU machines these benchmarks run on drift by 15-30 % between runs (other jobs, frequency), so an
absolute millisecond figure says little. Every contender therefore runs in the *same* processes,
alternating in short blocks, and comparisons use the ratio of step times measured close together.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PairSummary",
    "RatioInterval",
    "format_table",
    "interleaved_timing",
    "median_interval",
    "percentile",
    "ratio_interval",
    "round_ratios",
    "rotated",
    "summarize_pair",
]


def interleaved_timing(
    steps: Mapping[str, Callable[[], None]],
    timed_steps: int,
    warmup_steps: int,
    block: int,
    on_block: Callable[[int, int, dict[str, list[float]]], None] | None = None,
    after_step: Mapping[str, Callable[[], None]] | None = None,
    cpu_times: dict[str, list[float]] | None = None,
    page_faults: dict[str, list[int]] | None = None,
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

    ``cpu_times``, when given, receives per contender the CPU seconds this process (all its threads:
    autograd, communication, gloo's) spent in each timed step, aligned like the wall times. On a machine
    with as many busy ranks as cores, wall time moves with whichever thread the scheduler ran; CPU time
    counts the work each contender did and moves much less. ``page_faults``, when given, receives the minor
    page faults of this process in each timed step: memory the allocator took from the system afresh, whose
    first touch costs CPU time (see docs/benchmarks.md, "The allocator's lottery").
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
    for r in range(rounds):
        count = min(block, timed_steps - r * block)
        this_round: dict[str, list[float]] = {}
        for name in rotated(names, r):
            hook = (after_step or {}).get(name)
            samples, cpu_samples, fault_samples = _timed_block(
                steps[name], count, hook, page_faults is not None
            )
            this_round[name] = samples
            times[name].extend(samples)
            if cpu_times is not None:
                cpu_times.setdefault(name, []).extend(cpu_samples)
            if page_faults is not None:
                page_faults.setdefault(name, []).extend(fault_samples)
        if on_block is not None:
            on_block(r, rounds, {name: this_round[name] for name in names})
    return times


def _timed_block(
    step: Callable[[], None], count: int, after_step: Callable[[], None] | None, count_faults: bool
) -> tuple[list[float], list[float], list[int]]:
    """Run ``step`` ``count`` times: wall seconds, CPU seconds and minor page faults (if counted) of each."""
    clock, cpu_clock = time.perf_counter, time.process_time
    walls: list[float] = []
    cpus: list[float] = []
    faults: list[int] = []
    for _ in range(count):
        faults_before = _minor_faults() if count_faults else 0
        cpu_started, started = cpu_clock(), clock()
        step()
        walls.append(clock() - started)
        cpus.append(cpu_clock() - cpu_started)
        if count_faults:
            faults.append(_minor_faults() - faults_before)
        if after_step is not None:
            after_step()
    return walls, cpus, faults


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` in round ``round_index``'s order: rotated by one per round (A B C, B C A, C A B, ...), so every
    contender takes every position equally often (see :func:`interleaved_timing`)."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


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
    ratio_ci_low: float = float("nan")  # 95 % interval of the median ratio (median_interval)
    ratio_ci_high: float = float("nan")


def summarize_pair(baseline_s: Sequence[float], candidate_s: Sequence[float]) -> PairSummary:
    """Summarise equal-length, round-aligned step times in seconds (from :func:`interleaved_timing`)."""
    if len(baseline_s) != len(candidate_s) or not baseline_s:
        raise ValueError(
            f"need two equally long non-empty lists, got {len(baseline_s)} and {len(candidate_s)}"
        )
    ratios = [c / b for b, c in zip(baseline_s, candidate_s)]
    base = [1e3 * t for t in baseline_s]
    cand = [1e3 * t for t in candidate_s]
    low, high = median_interval(ratios)
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
        ratio_ci_low=low,
        ratio_ci_high=high,
    )


def median_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of ``values`` (about 95 % at ``z`` 1.96): the
    k-th smallest and k-th largest values, k = n/2 - z*sqrt(n)/2 (the sign test's interval, from the normal
    approximation to the binomial; no assumption on the shape of the step-time distribution, whose tail is
    long). ``(nan, nan)`` for fewer than 6 values, too few for 95 %."""
    n = len(values)
    if n < 6:
        return float("nan"), float("nan")
    ordered = sorted(values)
    k = max(1, math.floor(n / 2 - z * math.sqrt(n) / 2))  # 1-based
    return ordered[k - 1], ordered[n - k]


@dataclass(frozen=True)
class RatioInterval:
    """The ratio candidate/baseline of interleaved runs: the median over rounds and its 95 % interval.

    ``median`` is the median of the per-round ratios (:func:`round_ratios`); ``low``-``high`` its 95 %
    interval (:func:`ratio_interval`, nan with fewer than 6 rounds); ``rounds`` how many rounds it rests on.
    """

    median: float
    low: float
    high: float
    rounds: int

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the median (0.02: the ratio is known to +-2 %)."""
        return (self.high - self.low) / 2 / self.median

    def verdict(self, target: float | None) -> str:
        """``PASS`` when the interval's upper end is under ``target`` (the ratio is below it with 95 %
        confidence), ``MISS`` when its lower end is at or above it, ``UNRESOLVED`` when the interval holds
        the target (more rounds would decide); ``-`` without a target."""
        if target is None:
            return "-"
        if self.high < target:
            return "PASS"
        if self.low >= target:
            return "MISS"
        return "UNRESOLVED"

    def __str__(self) -> str:
        return f"{self.median:.3f} [95 % {self.low:.3f}-{self.high:.3f}, {self.rounds} rounds]"


def round_ratios(baseline_s: Sequence[float], candidate_s: Sequence[float], block: int) -> list[float]:
    """Per interleaved round (``block`` consecutive steps of each contender, from :func:`interleaved_timing`),
    the candidate's time over the baseline's: the sum of its steps in the round over the baseline's."""
    if len(baseline_s) != len(candidate_s) or not baseline_s or block < 1:
        raise ValueError(
            f"need two equally long non-empty lists and block >= 1, got {len(baseline_s)} and "
            f"{len(candidate_s)} steps, block={block}"
        )
    starts = range(0, len(baseline_s), block)
    return [sum(candidate_s[i : i + block]) / sum(baseline_s[i : i + block]) for i in starts]


def ratio_interval(baseline_s: Sequence[float], candidate_s: Sequence[float], block: int) -> RatioInterval:
    """The ratio candidate/baseline of round-aligned step times (seconds, from :func:`interleaved_timing`
    with ``block``), with a 95 % interval: the one rule every benchmark comparing ours with torch follows.

    Why rounds, not steps: steps inside one round run back to back under the same conditions (another job
    on the core, the CPU's clock), so they are not independent samples; an interval over n steps would claim
    ``sqrt(block)`` times more precision than the run has. Rounds alternate the contenders, so each round's
    ratio compares the two under the same conditions, and rounds are the units that vary independently.

    Why the median with the sign test's interval (:func:`median_interval`) rather than a t-interval on
    log-ratios or a bootstrap: on a shared machine a few rounds are hit by another job and their ratio lands
    far out; the median and the sign test's interval assume nothing about the shape of the distribution and
    move by at most one rank per such round, where a mean and its t-interval follow it. Its price is a
    somewhat wider interval for the same rounds when the machine is quiet.

    What it cannot see: a difference that is fixed for a whole process (where the allocator placed the
    buffers, which core each rank got) is the same in every round of the run; re-run the benchmark to see
    that spread.
    """
    ratios = round_ratios(baseline_s, candidate_s, block)
    low, high = median_interval(ratios)
    return RatioInterval(median=percentile(ratios, 50), low=low, high=high, rounds=len(ratios))


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns (first column left-aligned), for terminals and logs."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])
