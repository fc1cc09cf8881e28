"""Where a member stands between two step boundaries: one named phase, moved in one place.

A member is in exactly one of these phases; what the next boundary (the start of a step, an epoch's start,
a collective between steps) must do follows from it:

- ``HEAL_DUE``: a generation began with newcomers (or the run began): send them a live peer's state, then
  prove every replica equal;
- ``VERIFY_DUE``: the same, but this process's state is already there (the first generation's replicas were
  made equal by the module's construction; a newcomer took its state before its model existed): only prove;
- ``REGROUP_DUE``: a step or a collective failed, or a member was lost: the membership must change
  (:attr:`Phases.reason` says why); the regroup then decides between ``HEAL_DUE`` and ``IN_SYNC``;
- ``IN_SYNC``: this member's replica was proved equal to the others' and its group is the generation's;
- ``STEPPING``: inside :meth:`~lightning_ddpx.fault.manager.FaultTolerance.step`: a collective's failure is
  the step's, voted on when it ends.

``REGROUP_DUE`` supersedes a heal that was due: the regroup decides afresh from the new generation's
newcomers. Whether newcomers wait to be admitted is a separate fact (:attr:`Phases.admission_waiting`):
a committed vote reports it in any phase, and it waits, across steps, for a boundary that admits.
"""

from __future__ import annotations

import enum

__all__ = ["MemberPhase", "Phases"]


class MemberPhase(enum.Enum):
    HEAL_DUE = "heal due"
    VERIFY_DUE = "verify due"
    REGROUP_DUE = "regroup due"
    IN_SYNC = "in sync"
    STEPPING = "stepping"


_H, _V, _R, _S, _T = (
    MemberPhase.HEAL_DUE,
    MemberPhase.VERIFY_DUE,
    MemberPhase.REGROUP_DUE,
    MemberPhase.IN_SYNC,
    MemberPhase.STEPPING,
)
# phase -> the phases it may move to; a regroup ends in HEAL_DUE or IN_SYNC from any phase but STEPPING
# (an admission regroups from IN_SYNC, a heal or a verification that was due, too)
_MOVES: dict[MemberPhase, frozenset[MemberPhase]] = {
    _H: frozenset({_H, _V, _R, _S}),
    _V: frozenset({_H, _R, _S}),
    _R: frozenset({_H, _R, _S}),
    _S: frozenset({_H, _R, _S, _T}),
    _T: frozenset({_R, _S}),
}


class Phases:
    """One member's phase, the reason a regroup is due, and whether newcomers wait to be admitted."""

    def __init__(self) -> None:
        self.current = MemberPhase.HEAL_DUE  # the run's first boundary heals: from rank 0, or a survivor
        self.reason: str | None = None  # why the membership must change (only while REGROUP_DUE)
        # Independent of the phase: set by a committed vote that saw joiners, in any phase; cleared by the
        # boundary that admits them, which may come many steps later (the Trainer admits at epochs' starts).
        self.admission_waiting = False

    def move(self, to: MemberPhase, reason: str | None = None) -> None:
        """The one place the phase changes; a move the protocol never makes is a bug, raised at once."""
        if to not in _MOVES[self.current]:
            raise RuntimeError(
                f"lightning_ddpx fault tolerance: no move from {self.current.value!r} to {to.value!r} "
                "(a step() inside a step(), or a bug: please report it)."
            )
        if (to is MemberPhase.REGROUP_DUE) != (reason is not None):
            raise ValueError("lightning_ddpx fault tolerance: a regroup, and only a regroup, has a reason.")
        self.current, self.reason = to, reason

    @property
    def regroup_due(self) -> bool:
        return self.current is MemberPhase.REGROUP_DUE

    @property
    def heal_due(self) -> bool:
        """A heal (or only its verification) is due: this replica is not proved equal to the others' yet."""
        return self.current in (MemberPhase.HEAL_DUE, MemberPhase.VERIFY_DUE)
