"""Opt-in fault tolerance: a lost rank does not end the run (docs/fault-tolerance.md).

Rooms, each importing only the rooms listed before it (``tests/project/test_architecture.py`` keeps this order):

1. what a run is told and where it starts: :mod:`.options`, :mod:`.launch_env`;
2. the membership: :mod:`.membership` (generations of members agreed through the launcher's store),
   :mod:`.commit` (whether a step counts, agreed before any rank applies it);
3. facts and rules: :mod:`.stats` (what a run reports), :mod:`.phases` (where a member stands between
   boundaries), :mod:`.checks` (what cannot follow a membership change, refused by name),
   :mod:`.hook_state` (a hook's state across discarded steps and new generations);
4. the machinery: :mod:`.generations` (each generation's process group), :mod:`.transport` (how a
   newcomer's state travels), :mod:`.heal` (what it receives, and the proof);
5. :mod:`.steps`: the step protocol (votes, commits and discards, boundaries);
6. :mod:`.manager`: :class:`FaultTolerance`, a training process's part (the bare module's API);
7. :mod:`.launch`: the launcher, which hosts the run's store and supervises the processes.
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
