"""The end of a synchronised backward: bucket results in launch order, and which parameters were used.

Both ways a backward can end walk this one path: the plain finalize (:meth:`Reducer._finalize
<lightning_ddpx.engine.reducer.reducer.Reducer._finalize>` writes each bucket back as it arrives) and the optimizer
overlap (:mod:`lightning_ddpx.engine.optim.overlap` writes it back and steps its parameters). What they
share is here: buckets are waited for in launch order, the used-parameter bitmap at most once, and every
second spent waiting is counted (the step's exposed communication). What they do with a bucket whose
parameters this rank did not all use differs, and stays with them: finalize waits for the bitmap first,
the overlap steps the parameters this rank used and defers the rest until the bitmap arrives.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Protocol, Sized

import torch

__all__ = ["ResultsInOrder", "ReducedBuckets"]


class ReducedBuckets(Protocol):
    """What the end of backward asks of the reducer (:class:`~lightning_ddpx.engine.reducer.reducer.Reducer`)."""

    @property
    def buckets(self) -> Sized: ...

    def wait_bucket(self, b: int) -> Any:
        """Bucket ``b``'s reduced result, waited for."""

    def recorded_counts(self) -> list[int] | None:
        """Per-parameter use counts known without the bitmap (a static graph's record), or ``None``."""

    def shared_counts(self, bitmap: torch.futures.Future) -> list[int]:
        """Per-parameter use counts from the used-parameter bitmap's future."""


class ResultsInOrder:
    """Iterate over ``(b, result)`` in bucket order; :meth:`counts` gives per-parameter use counts.

    ``globally_used``: the used-parameter bitmap's future when this backward shares one
    (``find_unused_parameters``, a static graph's recording iteration), else ``None``.
    """

    def __init__(self, reducer: ReducedBuckets, globally_used: torch.futures.Future | None) -> None:
        self.reducer = reducer
        self._bitmap = globally_used
        # without a bitmap the counts are known now: a static graph's record, or None (every parameter used)
        self.known_counts: list[int] | None = reducer.recorded_counts()
        self.waited = 0.0  # seconds spent waiting for results and the bitmap
        self.last_arrival = time.perf_counter()  # when the last of them arrived

    @property
    def counts_pending(self) -> bool:
        """Whether the bitmap is still to be waited for (then :attr:`known_counts` are not final)."""
        return self._bitmap is not None

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for b in range(len(self.reducer.buckets)):
            started = time.perf_counter()
            result = self.reducer.wait_bucket(b)
            self._arrived(started)
            yield b, result

    def counts(self) -> list[int] | None:
        """Per parameter, how many ranks used it since the last synchronisation (``None``: all of them),
        from the bitmap when this backward shares one (waited for the first time only)."""
        if self._bitmap is not None:
            started = time.perf_counter()
            self.known_counts = self.reducer.shared_counts(self._bitmap)
            self._bitmap = None
            self._arrived(started)
        return self.known_counts

    def _arrived(self, started: float) -> None:
        self.last_arrival = time.perf_counter()
        self.waited += self.last_arrival - started
