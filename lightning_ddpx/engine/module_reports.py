"""What a wrapped model tells about its reduction: steps, hook, optimizer overlap, bucket plans, statistics.

These are the read-only views of :class:`~lightning_ddpx.DistributedDataParallel` (and torch's private
usage-logger pair), kept apart from the class that trains so that it reads as the DDP protocol's front:
each view only reads the module's reducer and the few attributes declared on :class:`ModuleReports`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddpx.engine.bucketing import BucketInfo
from lightning_ddpx.engine.comm_stats import CommStatsSummary, StepCommStats
from lightning_ddpx.engine.transport import CommHook
from lightning_ddpx.engine.usage_log import UsageLog, errors_logged, logged_options, logging_data

if TYPE_CHECKING:
    from lightning_ddpx.engine.reducer import Reducer
    from lightning_ddpx.engine.trainable_set import TrainableSet

__all__ = ["ModuleReports"]


class ModuleReports:
    """The views; the module provides what they read."""

    reducer: Reducer
    module: nn.Module
    process_group: dist.ProcessGroup
    _hook_registered: bool
    _trainable: TrainableSet
    _usage_log: UsageLog

    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        """torch's usage-logger dict, for the keys we fill truthfully (docs/engine.md lists them): the options,
        the parameters and buckets, the sampled iteration and the last error this module raised."""
        params = [p for _, p in self._trainable.trainable()]
        first_plan = self.reducer.plan_history[0][1]
        options = logged_options(self)
        return logging_data(self._usage_log, self.module, params, first_plan, self.process_group, options)

    @errors_logged
    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """torch's check (an integer >= 1); the rate paces ``iteration`` as torch's, no timings are taken."""
        self._usage_log.set_sample_rate(sample_rate)

    def _rebuilt_plan(self) -> list[BucketInfo] | None:
        return self.reducer.bucket_infos() if self.reducer.planner.rebuilt else None

    @property
    def synchronised_steps(self) -> int:
        """How many backward passes have synchronised gradients so far (``no_sync`` ones do not count)."""
        return self.reducer.iterations_synced

    @property
    def comm_hook(self) -> CommHook | None:
        return self.reducer.transport.hook if self._hook_registered else None

    @property
    def comm_hook_state(self) -> Any:
        return self.reducer.transport.state if self._hook_registered else None

    @property
    def overlapped_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer given to :meth:`overlap_optimizer_with`, or ``None``."""
        overlap = self.reducer.overlap
        return overlap.optimizer if overlap is not None else None

    @property
    def optimizer_stepped_in_backward(self) -> bool:
        """Whether the last synchronised backward stepped the overlapped optimizer (until the next forward)."""
        overlap = self.reducer.overlap
        return overlap is not None and overlap.stepped

    def reducer_state_dict(self) -> dict[str, Any]:
        """The bucket layout (parameter names in buffer order), plain values only, for checkpoints.

        Hooks with state (PowerSGD) key their memory by bucket; restoring the layout before the first
        resumed step lets that memory apply exactly, so a resumed run continues bit for bit.
        """
        return self.reducer.order_state()

    def bucket_plan(self) -> list[BucketInfo]:
        """The current buckets in launch order: index, bytes, dtype, device and parameter names."""
        return self.reducer.bucket_infos()

    def bucket_plan_history(self) -> list[tuple[int, list[BucketInfo]]]:
        """Every bucket plan this module used, as ``(synchronised iterations before it, plan)``.

        The first entry is the construction-time plan (torch's: one bucket per dtype unless
        ``find_unused_parameters``); a second one appears when buckets were rebuilt from the observed gradient
        order (after the first iteration; the second with ``static_graph``), or when a checkpoint's layout
        was loaded.
        """
        return list(self.reducer.plan_history)

    def comm_stats(self) -> StepCommStats | None:
        """Communication of the last synchronised step on this rank (``None`` before the first).

        Bytes handed to the hook, bytes its collectives sent (if the hook reports them, as every built-in
        hook does), time inside hook calls and exposed communication; see :mod:`lightning_ddpx.engine.comm_stats`.
        """
        return self.reducer.stats.last

    def take_comm_stats(self) -> CommStatsSummary | None:
        """Per-step means since the previous call (``None`` if no step synchronised since); starts anew."""
        return self.reducer.stats.window.take()
