"""A communication hook's state across discarded steps and membership changes.

The stateless hooks (allreduce, fp16, bf16, noop) keep nothing but the default group, which each
generation rebuilds. PowerSGD (and batched PowerSGD) keep two kinds of state
(:class:`~lightning_ddpx.hooks.PowerSGDState`):

- **shared**, equal on every member: the iteration (when compression starts), the generator of the Q seeds,
  the warm-start Q of each bucket. A step that fails part-way may have moved it on some members and not on
  others, so it is snapshotted before each step and put back on every member when the step is discarded;
  a newcomer receives it from the live peer that heals it.
- **per rank**: the error feedback. It differs between ranks by design; after a discarded step (whose
  residuals were never applied) it restarts from zero on every member, as it starts on a newcomer.

Each generation also drops the hook's per-bucket work buffers, which hold the old world size.

DiLoCo's state (:class:`~lightning_ddpx.hooks.diloco.DiLoCoState`: anchors, outer momentum, inner-step count)
is all shared and moves only at an outer exchange (each fragment's, for streaming DiLoCo), which the fault
tolerance snapshots and votes on itself
(:meth:`~lightning_ddpx.fault.manager.FaultTolerance.average_after_step`); a newcomer receives all of it.
With ``overlap_steps`` each exchange completes within the step that sends it (``complete_at_send``), so
that it is voted on there and no exchange is in flight on a group a membership change destroys; its mean
is applied ``overlap_steps`` later, as without fault tolerance (the same numbers; the communication is
not hidden behind the inner steps).
Post-local SGD's (:class:`~lightning_ddpx.hooks.PostLocalSGDState`): its iteration moves in backward during
the warm-up, so it is snapshotted and put back like PowerSGD's; its averager's step moves at an average,
which the fault tolerance votes on like DiLoCo's outer step; each generation makes its gradient subgroup
again (``subgroup=1``: every rank on its own; ``None``: the ranks on each machine of the new membership).
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_ddpx.hooks.diloco import DiLoCoState
from lightning_ddpx.hooks.post_local_sgd import PostLocalSGDState
from lightning_ddpx.hooks.powersgd.state import PowerSGDState

__all__ = ["HookState"]

log = logging.getLogger("lightning_ddpx.fault")


class HookState:
    """The fault tolerance's handle on one registered hook state (``None`` for the stateless hooks)."""

    def __init__(self, state: Any) -> None:
        self.state = state if isinstance(state, PowerSGDState) else None
        self.diloco = state if isinstance(state, DiLoCoState) else None
        if self.diloco is not None:  # no exchange in flight across steps, where no vote could cover it
            self.diloco.complete_at_send = True
            overlap = self.diloco.options.overlap_steps
            if overlap:
                log.warning(
                    "lightning_ddpx fault tolerance: DiLoCo with overlap_steps=%d: each exchange completes within "
                    "the step that sends it (where the members vote on it) and its mean is applied %d step(s) "
                    "later, as without fault tolerance: the same numbers, but the communication is not hidden "
                    "behind the inner steps.",
                    overlap,
                    overlap,
                )
        self.post_local_sgd = state if isinstance(state, PostLocalSGDState) else None
        self._before_step: dict[str, Any] | None = None
        self._iter_before_step = 0

    def before_step(self) -> None:
        if self.state is not None:
            self._before_step = self.state.shared_state_dict()
        if self.post_local_sgd is not None:
            self._iter_before_step = self.post_local_sgd.iter

    def after_discarded_step(self) -> None:
        """Every member back to the shared state of before the step; error feedback from zero."""
        if self.state is not None and self._before_step is not None:
            self.state.load_state_dict({"shared": self._before_step, "per_rank": {}})
        if self.post_local_sgd is not None:  # the warm-up's count: global or local averaging next
            self.post_local_sgd.iter = self._iter_before_step

    def after_regroup(self) -> None:
        if self.state is not None:
            self.state.runtime.clear()  # plans and buffers sized for the old world
        if self.post_local_sgd is not None:
            self.post_local_sgd.regroup()  # a collective of the new generation's members

    def shared(self) -> dict[str, Any] | None:
        """What a newcomer (or a checkpoint) gets: the shared part only."""
        if self.diloco is not None:
            return self.diloco.state_dict()["shared"]
        if self.post_local_sgd is not None:
            return self.post_local_sgd.state_dict()["shared"]
        return self.state.shared_state_dict() if self.state is not None else None

    def load_shared(self, shared: dict[str, Any] | None) -> None:
        """Adopt a live peer's (or a checkpoint's) shared state; this process's error feedback starts at zero."""
        if shared is None:
            return
        if self.diloco is not None:
            self.diloco.load_state_dict({"shared": shared, "per_rank": {}})
        elif self.post_local_sgd is not None:
            self.post_local_sgd.load_state_dict({"shared": shared, "per_rank": {}})
        elif self.state is not None:
            self.state.load_state_dict({"shared": shared, "per_rank": {}})
