"""What a fault-tolerant run reports: the membership, what failures cost, and its events."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["FaultToleranceStats"]

log = logging.getLogger("lightning_ddpx.fault")


@dataclass
class FaultToleranceStats:
    """What loggers get: the membership and what failures cost."""

    generation: int = 0
    world_size: int = 0
    failures: int = 0  # steps discarded because a member was lost
    members_lost: int = 0
    newcomers_healed: int = 0
    last_recovery_s: float | None = None  # from a failed step (or average) to the next committed one
    last_heal_s: float | None = None  # a newcomer's state sent, received and verified
    events: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """The figures as scalars for a logger (``logger.log_metrics(ft.stats.metrics(), step)``), under
        ``fault_tolerance/``; the two durations only once measured."""
        figures: dict[str, float] = {
            "fault_tolerance/generation": float(self.generation),
            "fault_tolerance/world_size": float(self.world_size),
            "fault_tolerance/failures": float(self.failures),
            "fault_tolerance/members_lost": float(self.members_lost),
            "fault_tolerance/newcomers_healed": float(self.newcomers_healed),
        }
        if self.last_recovery_s is not None:
            figures["fault_tolerance/last_recovery_s"] = self.last_recovery_s
        if self.last_heal_s is not None:
            figures["fault_tolerance/last_heal_s"] = self.last_heal_s
        return figures

    def note(self, uid: str, message: str) -> None:
        """An event: kept in :attr:`events` and logged as a warning (a membership change is worth seeing)."""
        self.events.append(message)
        log.warning("lightning_ddpx fault tolerance (process %s): %s", uid, message)
