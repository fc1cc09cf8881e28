"""Opt-in fault tolerance: a lost rank does not end the run (docs/fault-tolerance.md).

- :mod:`~lightning_ddpx.fault.launch`: the launcher, which hosts the run's store and supervises the processes;
- :mod:`~lightning_ddpx.fault.membership`: generations of members agreed through that store;
- :mod:`~lightning_ddpx.fault.commit`: whether a step counts, agreed before any rank applies it;
- :mod:`~lightning_ddpx.fault.manager`: :class:`FaultTolerance`, a training process's part (the bare module's API).
"""

from lightning_ddpx.fault.manager import FaultTolerance, FaultToleranceStats, StepOutcome
from lightning_ddpx.fault.membership import FaultToleranceError, Generation, RunEnded
from lightning_ddpx.fault.options import FaultToleranceOptions

__all__ = [
    "FaultTolerance",
    "FaultToleranceError",
    "FaultToleranceOptions",
    "FaultToleranceStats",
    "Generation",
    "RunEnded",
    "StepOutcome",
]
