"""What communication cost in each synchronised step, collected by the reducer without extra collectives.

Per step the reducer records: the bytes handed to the communication hook (the bucket buffers), the bytes
the hook's collectives actually carried (reported by the hook through
:func:`~lightning_ddpx.engine.buckets.grad_bucket.record_bytes_sent`; ``None`` for hooks that do not report, such as
torch's), the wall time spent inside hook calls, and the *exposed* communication: how long the end of
backward waited for outstanding results, i.e. the part of communication that overlap with backward did not
hide. Recording is a few additions and two clock reads per bucket; nothing is logged per bucket.

:class:`CommStatsWindow` averages steps between two reads, which is what a logger wants every N steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lightning_ddpx.engine.profiling import label

__all__ = ["CommStatsRecorder", "CommStatsSummary", "CommStatsWindow", "NoCommStats", "StepCommStats"]


@dataclass(frozen=True)
class StepCommStats:
    """Communication of one synchronised step on this rank."""

    iteration: int  # synchronised iterations completed, this one included (1 = the first)
    buckets: int  # buckets reduced
    bytes_to_hook: int  # bytes of the bucket buffers handed to the hook
    bytes_sent: int | None  # payload bytes of the hook's collectives; None: the hook does not report
    hook_s: float  # wall time inside hook calls (a blocking hook's collectives included)
    exposed_comm_s: float  # time the end of backward waited for results: communication not overlapped

    @property
    def compression_ratio(self) -> float | None:
        """bytes_to_hook / bytes_sent: 1 for allreduce, 2 for fp16 on fp32 gradients, ~100s for PowerSGD."""
        if not self.bytes_sent:
            return None
        return self.bytes_to_hook / self.bytes_sent


@dataclass(frozen=True)
class CommStatsSummary:
    """Per-step means over a window of synchronised steps (what a logger records every N steps)."""

    steps: int
    last_iteration: int
    buckets: float
    bytes_to_hook: float
    bytes_sent: float | None  # None if any step in the window had a hook that does not report
    hook_ms: float
    exposed_comm_ms: float
    exposed_comm_max_ms: float

    @property
    def compression_ratio(self) -> float | None:
        if not self.bytes_sent:
            return None
        return self.bytes_to_hook / self.bytes_sent

    def as_metrics(self, prefix: str = "ddpx/") -> dict[str, float]:
        """Flat ``{name: value}`` for ``logger.log_metrics``; unknown values are left out, not logged as 0."""
        metrics = {
            "buckets": self.buckets,
            "bytes_to_hook": self.bytes_to_hook,
            "hook_ms": self.hook_ms,
            "exposed_comm_ms": self.exposed_comm_ms,
            "exposed_comm_max_ms": self.exposed_comm_max_ms,
        }
        if self.bytes_sent is not None:
            metrics["bytes_sent"] = self.bytes_sent
        ratio = self.compression_ratio
        if ratio is not None:
            metrics["compression_ratio"] = ratio
        return {prefix + name: float(value) for name, value in metrics.items()}


class CommStatsWindow:
    """Running totals of :class:`StepCommStats` since the last :meth:`take`."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._last_iteration = 0
        self._buckets = 0
        self._to_hook = 0
        self._sent: int | None = 0
        self._hook_s = 0.0
        self._exposed_s = 0.0
        self._exposed_max_s = 0.0

    def add(self, step: StepCommStats) -> None:
        self._steps += 1
        self._last_iteration = step.iteration
        self._buckets += step.buckets
        self._to_hook += step.bytes_to_hook
        self._sent = None if self._sent is None or step.bytes_sent is None else self._sent + step.bytes_sent
        self._hook_s += step.hook_s
        self._exposed_s += step.exposed_comm_s
        self._exposed_max_s = max(self._exposed_max_s, step.exposed_comm_s)

    def take(self) -> CommStatsSummary | None:
        """The means since the last call (``None`` if no step synchronised since), and start a new window."""
        n = self._steps
        if n == 0:
            return None
        summary = CommStatsSummary(
            steps=n,
            last_iteration=self._last_iteration,
            buckets=self._buckets / n,
            bytes_to_hook=self._to_hook / n,
            bytes_sent=None if self._sent is None else self._sent / n,
            hook_ms=1e3 * self._hook_s / n,
            exposed_comm_ms=1e3 * self._exposed_s / n,
            exposed_comm_max_ms=1e3 * self._exposed_max_s,
        )
        self._reset()
        return summary


HookCall = Callable[..., torch.futures.Future]


class _HookTimer:
    """Calls hooks (``timer(hook, *args)``) and keeps the seconds spent in each: one per iteration, so a call
    that a communication thread makes late still counts in the iteration that launched it."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: list[float] = []  # appended to from whichever thread runs the hook (atomic)

    def __call__(self, hook: HookCall, *args: Any) -> torch.futures.Future:
        started = time.perf_counter()
        try:
            with label("lightning_ddpx::comm_hook"):
                return hook(*args)
        finally:
            self.seconds.append(time.perf_counter() - started)


def _untimed(hook: HookCall, *args: Any) -> torch.futures.Future:
    return hook(*args)


class CommStatsRecorder:
    """The reducer's statistics of the current synchronised step, and of the steps before it.

    Per bucket: :meth:`timed` counts the bytes handed over and returns what calls the hook, timing it; the
    hooks report what their collectives carried into :attr:`sent_log`. The lists are appended to from
    whichever thread runs the hook (appends are atomic)."""

    def __init__(self) -> None:
        self.last: StepCommStats | None = None
        self.window = CommStatsWindow()
        self.begin()

    def begin(self) -> None:
        """A new iteration: nothing recorded yet."""
        self._bytes_to_hook = 0
        self.sent_log: list[int] | None = []
        self._timer = _HookTimer()

    def timed(self, nbytes: int) -> Callable[..., torch.futures.Future]:
        """A hook is about to be handed one bucket of ``nbytes``: count them, and return this iteration's
        :class:`_HookTimer`, to call the hook with (``timed(nbytes)(hook, *args)``, on any thread)."""
        self._bytes_to_hook += nbytes
        return self._timer

    def finish(self, iteration: int, buckets: int, exposed_comm_s: float) -> None:
        """The synchronised iteration ``iteration`` completed: keep its statistics."""
        sent = self.sent_log
        self.last = StepCommStats(
            iteration=iteration,
            buckets=buckets,
            bytes_to_hook=self._bytes_to_hook,
            bytes_sent=sum(sent) if sent else None,
            hook_s=sum(self._timer.seconds),
            exposed_comm_s=exposed_comm_s,
        )
        self.window.add(self.last)


class NoCommStats(CommStatsRecorder):
    """Records nothing: what a benchmark hands the reducer to measure what recording costs
    (``benchmarks/bench_stats.py``)."""

    def begin(self) -> None:
        self.sent_log = None

    def timed(self, nbytes: int) -> Callable[..., torch.futures.Future]:
        return _untimed

    def finish(self, iteration: int, buckets: int, exposed_comm_s: float) -> None:
        pass
