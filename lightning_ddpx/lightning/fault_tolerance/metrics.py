"""torchmetrics' own syncs under ``fault_tolerance``: a loss during a metric's ``compute()`` does not end a survivor.

A torchmetrics ``Metric`` gathers its states itself (``Metric.sync``, on the default group), not through the
strategy, so without this a member lost during validation made every survivor's next ``compute()`` raise,
and the run ended. :class:`MetricSyncGuard` routes each metric's ``sync`` through the fault tolerance's
between-steps rule, as the strategy's own ``reduce``/``all_gather`` are routed:

- between steps, a sync that fails on any member is run again by every member over the members present
  (the fault tolerance's between-steps rule): ``compute()`` gives the survivors' value, the same on every
  member. torchmetrics gathers every state before it writes any, so a failed sync leaves the metric
  unsynced; a member whose sync succeeded while another's failed unsyncs it before the second attempt;
- inside a step (``dist_sync_on_step=True``) a failure is the step's, voted on and discarded like any other.

The guard is put on the metrics of the module at set-up and taken off at teardown, leaving the metrics as
they were (a metric holding a function of ours would not pickle).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from lightning_ddpx.lightning import _compat as lightning_compat

__all__ = ["MetricSyncGuard"]

BetweenSteps = Callable[[Callable[[], Any], Callable[[], Any]], Any]  # (run, fallback) -> result


class MetricSyncGuard:
    """Routes the ``sync`` of every torchmetrics metric in the modules it guards through ``between_steps``."""

    def __init__(self, between_steps: BetweenSteps) -> None:
        self._between_steps = between_steps
        self._guarded: list[Any] = []

    def guard(self, module: nn.Module) -> int:
        """Guard each metric in ``module`` (its submodules included) not guarded yet; returns how many."""
        try:
            from torchmetrics import Metric
        except ImportError:  # no torchmetrics: nothing syncs by itself
            return 0
        added = 0
        for metric in module.modules():
            if isinstance(metric, Metric) and not any(metric is known for known in self._guarded):
                metric.sync = self._fault_tolerant(metric)  # an instance attribute over the method
                self._guarded.append(metric)
                added += 1
        return added

    def release(self) -> None:
        """Give every guarded metric its own ``sync`` back."""
        for metric in self._guarded:
            metric.__dict__.pop("sync", None)
        self._guarded = []

    def _fault_tolerant(self, metric: Any) -> Callable[..., None]:
        between_steps, sync = self._between_steps, metric.sync

        def fault_tolerant_sync(*args: Any, **kwargs: Any) -> None:
            def attempt() -> None:
                # run again after another member's sync failed: this member's first one may have succeeded
                metric.unsync(should_unsync=lightning_compat.metric_is_synced(metric))
                sync(*args, **kwargs)

            between_steps(attempt, lambda: None)  # fallback (a newcomer not healed yet): left unsynced

        return fault_tolerant_sync
