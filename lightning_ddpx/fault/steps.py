"""The step protocol: each step (and each collective between steps) voted on, committed or discarded alike
on every member, and the membership changed only at a step boundary.

A voted section runs this member's collectives; a communication failure in it becomes this member's
``abort`` vote (:mod:`~lightning_ddpx.fault.commit`) and releases its group, so that a peer blocked on it
fails at once. Every member reads one decision: commit (apply the step) or abort (no member applies it, and
the next boundary regroups over the survivors, :mod:`~lightning_ddpx.fault.generations`, and heals any
newcomer, :mod:`~lightning_ddpx.fault.heal`). Where a member stands between boundaries is one
:class:`~lightning_ddpx.fault.phases.MemberPhase`.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import is_communication_failure
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.fault.checks import refuse_join, refuse_unsupported_model
from lightning_ddpx.fault.commit import ABORT, COMMIT_AND_ADMIT, vote
from lightning_ddpx.fault.generations import Generations
from lightning_ddpx.fault.heal import Healer
from lightning_ddpx.fault.hook_state import HookState
from lightning_ddpx.fault.phases import MemberPhase, Phases
from lightning_ddpx.fault.stats import FaultToleranceStats

__all__ = ["Replica", "StepOutcome", "StepProtocol", "first_line", "forget_frames"]

_Result = TypeVar("_Result")

# why a member whose own collectives succeeded discards a step: the vote does not say who aborted
_ANOTHER_ABORTED = "another member's collectives failed, or a member was lost before voting"


@dataclass
class StepOutcome:
    """What :meth:`StepProtocol.step` decided for one step."""

    committed: bool = False  # every member's collectives succeeded: apply the step
    error: str | None = None  # this member's failure, if it had one (its first line)


@dataclass
class Replica:
    """The model this process trains and its hook, as attached: what a regroup moves onto the new group."""

    model: DistributedDataParallel | None = None
    hook: tuple[Any, Any] | None = None  # (state, hook), registered on the model
    hook_state: HookState = field(default_factory=lambda: HookState(None))  # across discards and regroups


class StepProtocol:
    """Steps, boundaries and collectives between steps, voted on by every member of the generation."""

    def __init__(
        self,
        generations: Generations,
        healer: Healer,
        replica: Replica,
        stats: FaultToleranceStats,
        note: Callable[[str], None],
    ) -> None:
        self.generations, self.healer, self.replica = generations, healer, replica
        self.stats, self._note = stats, note
        self.phases = Phases()
        self.steps_committed = 0
        self._failed_at: float | None = None  # when the failure being recovered from was seen
        # The model's set-up is refused or accepted once, at the first step (its optimizer overlap is set
        # after the wrap): a latch, independent of the phases.
        self._checked = False

    # -------------------------------------------------------------------------------------- the steps
    @property
    def inside_step(self) -> bool:
        """Inside :meth:`step`: a collective's failure is the step's."""
        return self.phases.current is MemberPhase.STEPPING

    @property
    def in_sync(self) -> bool:
        """Whether a collective outside a step runs now: this process's replica has been verified equal to
        the others' (a newcomer's has not, before its first boundary, and nor has anyone's before the
        run's first)."""
        return not self.phases.heal_due and dist.is_initialized()

    @contextlib.contextmanager
    def step(self, admit: bool = True) -> Iterator[StepOutcome]:
        """See :meth:`FaultTolerance.step <lightning_ddpx.fault.manager.FaultTolerance.step>`."""
        model = self.replica.model
        if model is None:
            raise RuntimeError("lightning_ddpx fault tolerance: call wrap(module) before the first step().")
        refuse_join(model)  # every member alike, before any collective of the step
        if not self._checked:
            refuse_unsupported_model(model, self.replica.hook[1] if self.replica.hook is not None else None)
            self._checked = True
        # with parameter averaging the replicas differ between syncs: newcomers join after one
        self.at_boundary(admit and model.parameter_averaging is None)
        self.replica.hook_state.before_step()
        outcome = StepOutcome()
        self.phases.move(MemberPhase.STEPPING)
        try:
            yield outcome
        except Exception as error:  # noqa: BLE001 - only communication failures are voted on; others re-raised
            outcome.error = self._failure_to_vote(error)
            if outcome.error is None:
                raise
            del error
            self._release_group()  # peers still blocked on this member in the failed step fail at once
        finally:
            if self.phases.current is MemberPhase.STEPPING:  # (an error of the user's regroups instead)
                self.phases.move(MemberPhase.IN_SYNC)
        decision = self._vote(outcome.error is None)
        outcome.committed = decision != ABORT
        if outcome.committed:
            self.steps_committed += 1
            self._recovered()
            if decision == COMMIT_AND_ADMIT:
                self.phases.admission_waiting = True
        else:
            self.replica.hook_state.after_discarded_step()  # the same shared hook state on every member again
            self.stats.failures += 1
            self._failed()
            cause = outcome.error if outcome.error is not None else _ANOTHER_ABORTED
            self._note(
                f"step {self.steps_committed} discarded on every member of generation "
                f"{self.generations.current.number} ({cause})"
            )
            self.phases.move(MemberPhase.REGROUP_DUE, f"step {self.steps_committed} failed")

    def boundary(self, admit: bool = True) -> None:
        """A step boundary without a step (the Trainer's each epoch's start): apply a pending membership
        change -- admitting waiting newcomers if ``admit`` -- then agree, through the store, that every
        member reached this point in the same generation (a member lost or gone ahead to a new generation
        makes another one first). Every member calls it at the same point."""
        if self.replica.model is None:
            raise RuntimeError("lightning_ddpx fault tolerance: call wrap(module) before boundary().")
        while True:
            self.at_boundary(admit)
            decision = self._vote(ok=True)
            if decision == ABORT:
                self.phases.move(MemberPhase.REGROUP_DUE, "a member was lost at a boundary")
            elif decision == COMMIT_AND_ADMIT and admit:
                self.phases.admission_waiting = True
            else:
                return

    def prepare_step(self) -> None:
        """Apply a membership change decided since the last step now, before a step whose work begins
        before :meth:`step` (the Trainer's gradient accumulation: micro-batches that accumulate locally,
        then one that synchronises inside ``step()``), so that all of it runs in the new group. Every
        member calls it at the same point. Newcomers are not admitted here."""
        self.at_boundary(admit=False)

    def outside_step(
        self, run: Callable[[], _Result], fallback: Callable[[], _Result], retry: bool = True
    ) -> _Result:
        """See :meth:`FaultTolerance.outside_step <lightning_ddpx.fault.manager.FaultTolerance.outside_step>`."""
        if self.inside_step:
            return run()  # inside a step: a failure is the step's, voted on by step()
        if not self.in_sync:
            return fallback()
        while True:
            self.at_boundary(admit=False)  # a failed step's regroup, before the collective
            result, decision, error = self._run_voted(run)
            if decision != ABORT:
                return result  # type: ignore[return-value]
            if error is None:
                self._release_group()
            self._failed()
            cause = error if error is not None else _ANOTHER_ABORTED
            reason = f"a collective between steps failed ({cause})"
            self.phases.move(MemberPhase.REGROUP_DUE, reason)
            self._note(
                f"{reason}; every member regroups now"
                + (" and runs it again" if retry else ", each with its own answer to it")
            )
            if not retry:
                self.at_boundary(admit=False)
                return fallback()

    def agree(self, decision: bool) -> bool:
        """``decision``, taken between steps from a collective that may have failed on some members and not
        on others (a reduced boolean: early stopping's), made one decision on every member: the first
        member's to reach the store. Every member calls it at the same points, in the same order."""
        return self.generations.agree("1" if decision else "0") == "1"

    def average_after_step(self, optimizers: Any = None, admit: bool = True) -> bool:
        """See :meth:`FaultTolerance.average_after_step
        <lightning_ddpx.fault.manager.FaultTolerance.average_after_step>`."""
        model = self.replica.model
        if model is None:
            raise RuntimeError(
                "lightning_ddpx fault tolerance: call wrap(module) before average_after_step()."
            )
        averaging = model.parameter_averaging
        due_next = getattr(averaging, "due_next", None)
        if averaging is None or due_next is None or not due_next():
            return model.average_parameters_after_step(optimizers)  # counting only: no collective
        params = [p for p in model.parameters() if p.requires_grad]
        saved_params = [p.detach().clone() for p in params]
        saved_state = averaging.state_dict()
        while True:
            changed, decision, error = self._run_voted(
                lambda: model.average_parameters_after_step(optimizers)
            )
            if decision != ABORT:
                self.at_boundary(admit)  # waiting newcomers join here (the Trainer: at an epoch's start)
                return bool(changed)
            with torch.no_grad():
                for param, saved in zip(params, saved_params):
                    param.copy_(saved)
            averaging.load_state_dict(saved_state)
            self.stats.failures += 1
            self._failed()
            cause = error if error is not None else _ANOTHER_ABORTED
            self._note(
                f"{averaging.name} after step {self.steps_committed} failed on generation "
                f"{self.generations.current.number} ({cause}); every member put its parameters back, the "
                "survivors run it again"
            )
            self.phases.move(MemberPhase.REGROUP_DUE, "an outer step failed")
            self.at_boundary(admit=False)

    def receive_state(self) -> bool:
        """A newcomer receives its state now, before its model exists, instead of at its first step (the
        members send it when they admit it); returns whether this process is such a newcomer. The first step
        then only verifies the replicas. Call right after construction, or never."""
        generation = self.generations.current
        if generation.number == 1 or self.generations.uid not in generation.newcomers:
            return False
        while True:
            try:
                if self.phases.regroup_due:
                    self._regroup(self.phases.reason or "", admit=True)
                self.healer.transfer(self.generations.current, self.generations.uid)
                if self.phases.current is MemberPhase.HEAL_DUE:
                    self.phases.move(MemberPhase.VERIFY_DUE)  # the state is here: the first step verifies
                return True
            except Exception as error:  # noqa: BLE001 - communication failures regroup; others propagate
                if not is_communication_failure(error):
                    raise
                reason = f"a member was lost while this newcomer was healed ({first_line(error)})"
                forget_frames(error)
                self.phases.move(MemberPhase.REGROUP_DUE, reason)

    # ---------------------------------------------------------------------------------- boundaries
    def at_boundary(self, admit: bool) -> None:
        """Apply a membership change decided by the last step (with the waiting newcomers if ``admit``), then
        a heal that is due; a member lost meanwhile (while the group was rebuilt or a newcomer healed)
        makes another one."""
        phases = self.phases
        while phases.regroup_due or phases.heal_due or (admit and phases.admission_waiting):
            try:
                if phases.regroup_due or (admit and phases.admission_waiting):
                    self._regroup(phases.reason or "newcomers waiting", admit)
                    phases.admission_waiting = phases.admission_waiting and not admit
                if phases.heal_due:
                    self._heal()
            except Exception as error:  # noqa: BLE001 - communication failures regroup; others propagate
                if not is_communication_failure(error):
                    raise
                reason = f"a member was lost while the membership changed ({first_line(error)})"
                forget_frames(error)  # its frames would keep the failed group's connections open
                phases.move(MemberPhase.REGROUP_DUE, reason)

    def _regroup(self, reason: str, admit: bool) -> None:
        model = self.replica.model
        if model is not None:
            model.release_process_group()  # the old group's connections close when it is destroyed
        generation = self.generations.next(reason, admit)
        if model is not None:
            model.use_process_group(dist.group.WORLD, comm_hook=self.replica.hook)
        self.replica.hook_state.after_regroup()
        # a newcomer healed early takes part again: the sources send again
        self.phases.move(MemberPhase.HEAL_DUE if generation.newcomers else MemberPhase.IN_SYNC)

    def _heal(self) -> None:
        """Send the newcomers the state of the lowest-ranked member that was there before (rank 0 at the
        start) unless they have it already, then prove every replica equal. Every member takes part."""
        model = self.replica.model
        assert model is not None
        started = time.monotonic()
        generation, uid = self.generations.current, self.generations.uid
        size = (
            None if self.phases.current is MemberPhase.VERIFY_DUE else self.healer.transfer(generation, uid)
        )
        self.healer.verify(model, generation)
        self.generations.membership.mark_healthy()
        self.phases.move(MemberPhase.IN_SYNC)
        if generation.number > 1:
            self.stats.newcomers_healed += len(generation.newcomers)
            self.stats.last_heal_s = time.monotonic() - started
            sent = f" ({size / 2**20:.1f} MiB)" if size is not None else ""
            self._note(
                f"healed {', '.join(generation.newcomers)} from {min(generation.previous)} in "
                f"{self.stats.last_heal_s:.2f} s{sent}; replicas verified"
            )

    # -------------------------------------------------------------------------------- the votes
    def _run_voted(self, run: Callable[[], _Result]) -> tuple[_Result | None, str, str | None]:
        """``run()`` between steps as a voted section: a communication failure in it becomes this member's
        ``abort`` (its group released, so that peers blocked on it fail at once); any other error makes the
        others abort and propagates. Returns ``run()``'s result (``None`` when it failed), the decision every
        member reads, and this member's failure (its first line) or ``None``. A decision other than
        ``abort`` ends a recovery, and one that saw newcomers waiting has them admitted when allowed."""
        result, error = None, None
        try:
            result = run()
        except Exception as failure:  # noqa: BLE001 - only communication failures are voted on
            error = self._failure_to_vote(failure)
            if error is None:
                raise
            del failure
            self._release_group()
        decision = self._vote(error is None)
        if decision != ABORT:
            self._recovered()  # a failed section rerun: the survivors are going again
            self.phases.admission_waiting = self.phases.admission_waiting or decision == COMMIT_AND_ADMIT
        return result, decision, error

    def _vote(self, ok: bool) -> str:
        """This member's vote on the generation's next attempt (:func:`~lightning_ddpx.fault.commit.vote`); a
        member that does not vote within ``collective_timeout_s`` aborts the attempt, as a silent peer fails
        a collective."""
        generations = self.generations
        generations.attempt += 1
        return vote(
            generations.store,
            generations.membership,
            generations.current,
            generations.attempt,
            ok,
            generations.options.collective_timeout_s,
        )

    def _failed(self) -> None:
        self._failed_at = self._failed_at or time.monotonic()

    def _recovered(self) -> None:
        """A voted section committed: if one failed before, record how long the survivors took to go on."""
        if self._failed_at is not None:
            self.stats.last_recovery_s = time.monotonic() - self._failed_at
            self._failed_at = None

    def _failure_to_vote(self, error: BaseException) -> str | None:
        """What this member votes about ``error`` raised inside a voted section: a communication failure
        becomes its ``abort`` reason (its first line: text only, and the finished frames it holds cleared, as
        the traceback would keep the old group alive); for any other error the others are told to abort and
        ``None`` says to re-raise it."""
        if not is_communication_failure(error):
            self._abandon_step()  # the others must not wait for this member's vote
            return None
        forget_frames(error)
        return first_line(error)

    def _release_group(self) -> None:
        if self.replica.model is not None:
            self.replica.model.release_process_group()
        self.generations.release()

    def _abandon_step(self) -> None:
        """An error of the user's inside a voted section: vote ``abort`` so that the others discard it and
        regroup (without this process if it exits), then let the error propagate."""
        try:
            self._vote(ok=False)
        except Exception:  # noqa: BLE001 - the store is gone: the user's error is the one to report
            pass
        self.phases.move(MemberPhase.REGROUP_DUE, f"process {self.generations.uid} raised inside step()")


def forget_frames(error: BaseException) -> None:
    """Let go of the frames in ``error``'s tracebacks (its causes' too): while the error is handled, the
    context manager machinery still holds it, and those frames (the reducer's gradient hook, the failed
    collective's) would keep the failed group, and its open connections, alive until the handling ends.
    Clearing a finished frame's locals is not enough: a frame keeps its function, and a closure (the
    reducer's per-parameter hook) keeps the reducer; so the tracebacks are dropped too (the error was
    voted on by its first line, which is what the logs say)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)  # skips frames still running (the caller's)
            error.__traceback__ = None
        error = error.__cause__ or error.__context__  # type: ignore[assignment]


def first_line(cause: Any) -> str:
    text = str(cause).strip().splitlines()
    return text[0][:200] if text else type(cause).__name__
