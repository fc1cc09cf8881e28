"""``static_graph=True``: what the first synchronised backward recorded, and the checks against it.

torch's meaning: every synchronised iteration uses the same parameters, each receiving its gradient the same
number of times per backward. So the first synchronised backward only *records*: it counts the gradient
hooks of every parameter and reduces all buckets at its end (a parameter's gradient may still grow until
backward ends, e.g. when reentrant activation checkpointing runs a parameter's backward twice). Later
iterations need no autograd-graph walk: recorded-unused parameters are marked ready when backward starts,
a parameter is ready when its count is reached, and parameters unused on every rank keep their gradient
(recorded once, with one allreduce of the used bitmap, instead of one per iteration).
"""

from __future__ import annotations

import warnings
from typing import Sequence

__all__ = ["StaticGraph", "allow_late_static_graph", "warn_find_unused_not_needed"]


def allow_late_static_graph(
    already_static: bool, iterations_synced: int, idle: bool, find_unused_parameters: bool
) -> bool:
    """torch's checks for ``_set_static_graph()`` after wrapping: whether to make the module static now.

    Called again it warns and changes nothing; once a synchronising forward ran it raises (that iteration
    would not record: ``idle`` is false from the forward on); with ``find_unused_parameters`` it warns that
    the flag is not needed, as torch's does.
    """
    if already_static:
        warnings.warn(
            "lightning_ddpx.DistributedDataParallel: static_graph is already set (You've set static_graph "
            "to be True, no need to set it again.).",
            stacklevel=4,  # the user's call (through errors_logged and the method)
        )
        return False
    if iterations_synced > 0 or not idle:
        raise RuntimeError(
            "lightning_ddpx.DistributedDataParallel: _set_static_graph() was called after "
            f"{iterations_synced} synchronised iteration(s) (or after a synchronising forward); "
            "the static graph is recorded in the first one. Call it right after wrapping, or pass "
            "static_graph=True to the constructor (torch: set_static_graph() should be called before training "
            "loop starts and after DistributedDataParallel is constructed.)"
        )
    if find_unused_parameters:
        warn_find_unused_not_needed(stacklevel=5)  # the user's call (through errors_logged and the method)
    return True


def warn_find_unused_not_needed(stacklevel: int) -> None:
    """torch's warning when a static graph is asked for with ``find_unused_parameters=True``."""
    warnings.warn(
        "lightning_ddpx.DistributedDataParallel: with a static graph, find_unused_parameters=True is not "
        "needed: the static graph finds unused parameters in its first iteration (they must stay the same in "
        "every iteration). (torch: You passed find_unused_parameters=true to DistributedDataParallel, "
        "`_set_static_graph` will detect unused parameters automatically, so you do not need to set "
        "find_unused_parameters=true, just be sure these unused parameters will not change during training "
        "loop while calling `_set_static_graph`.)",
        stacklevel=stacklevel,
    )


class StaticGraph:
    """Per-parameter gradient counts: this backward's, and the recorded ones (``None`` until recorded)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.counts: list[int] | None = None  # gradient hooks per parameter in one backward
        self.globally_used: list[int] | None = None  # per parameter: ranks that used it (recorded)
        self.unused: list[int] = []  # parameters recorded with no gradient on this rank
        self.fires = [0] * len(self.names)
        self._last_fire: dict[int, None] = {}  # recording only: parameters by their last gradient

    @property
    def recording(self) -> bool:
        return self.counts is None

    def reset(self) -> None:
        self.fires = [0] * len(self.names)
        self._last_fire = {}

    def on_gradient(self, index: int) -> bool:
        """Count a gradient of parameter ``index``; ``True`` once its gradient is complete (never while
        recording: only the end of the first backward knows)."""
        self.fires[index] += 1
        if self.counts is None:
            self._last_fire.pop(index, None)
            self._last_fire[index] = None
            return False
        expected = self.counts[index]
        if self.fires[index] > expected:
            raise RuntimeError(
                f"lightning_ddpx: static_graph=True, but parameter {self.names[index]!r} received gradient "
                f"#{self.fires[index]} in this backward, while the first iteration recorded {expected}. The "
                "graph changed (other parameters used, or a parameter used more often). Pass "
                "static_graph=False (with find_unused_parameters=True if some parameters go unused)."
            )
        return self.fires[index] == expected

    def recording_order(self) -> list[int]:
        """Parameters in the order their gradients completed, then the unused ones: the bucket order to
        rebuild along and the order to mark them ready at the end of the recording backward."""
        used = list(self._last_fire)
        return used + [i for i in range(len(self.names)) if self.fires[i] == 0]

    def record(self, globally_used: list[int]) -> None:
        self.counts = list(self.fires)
        self.globally_used = list(globally_used)
        self.unused = [i for i, count in enumerate(self.counts) if count == 0]

    def unused_everywhere(self, index: int) -> bool:
        """Whether the recording found parameter ``index`` used on no rank (``False`` while recording)."""
        return self.globally_used is not None and self.globally_used[index] == 0

    def accumulated_message(self, index: int, rank: int) -> str:
        """A ``no_sync()`` backward gave a gradient to a parameter the recording found unused on every rank:
        its gradient would never be averaged (synchronised backwards leave such parameters untouched)."""
        return (
            f"lightning_ddpx (rank {rank}): static_graph=True, but parameter {self.names[index]!r} received a "
            "gradient in a no_sync() backward, while the first synchronised iteration recorded it as unused on "
            "every rank. Its accumulated gradient would never be averaged and the ranks would step with "
            "different gradients. The graph changed: pass static_graph=False with "
            "find_unused_parameters=True (which averages gradients accumulated in no_sync())."
        )

    def missing_message(self, missing: Sequence[int], rank: int) -> str:
        assert self.counts is not None
        parts = [f"{self.names[i]!r} ({self.fires[i]} of {self.counts[i]})" for i in missing[:10]]
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        return (
            f"lightning_ddpx (rank {rank}): static_graph=True, but parameter(s) {', '.join(parts)}{more} received "
            "fewer gradients in this backward than the first iteration recorded. The graph changed (a "
            "parameter unused this time, or the loss no longer depends on it). Pass static_graph=False (with "
            "find_unused_parameters=True if some parameters go unused)."
        )
