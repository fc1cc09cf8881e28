"""The bare module's fault tolerance: a lost rank does not end the run, a newcomer heals from a live peer.

    ft = FaultTolerance()                       # started by python -m lightning_ddpx.fault.launch
    model = ft.wrap(net)                        # our DistributedDataParallel over the current members
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ft.track(optimizer)                         # state a newcomer receives with the model's
    while ft.steps_committed < total_steps:
        with ft.step() as step:                 # a step boundary: a changed membership is applied here
            optimizer.zero_grad()
            loss_fn(model(batch_for(ft.steps_committed, ft.rank, ft.world_size))).backward()
        if step.committed:                      # every member's collectives succeeded
            optimizer.step()

What happens when a member is lost (docs/fault-tolerance.md):

1. The survivors' collectives fail (a dead peer's connection closes at once; a silent one after
   ``collective_timeout_s``); :meth:`FaultTolerance.step` catches the failure, destroys its group (so a
   survivor still waiting on it fails at once too) and votes ``abort`` (:mod:`~lightning_ddpx.fault.commit`).
   No member applies the step, whatever it saw.
2. At the next step boundary the survivors agree on the next generation
   (:mod:`~lightning_ddpx.fault.membership`), build a new default process group on the launcher's store
   (``ft/gen/<n>/pg/``), and move the module onto it (``use_process_group``).
3. The discarded step is retried by the survivors: ``steps_committed`` did not move, so a data order keyed on
   it hands the lost rank's share to the survivors (``rank`` and ``world_size`` are the new generation's).
4. A newcomer (a replacement) registers and is admitted at a step boundary after a committed step; the
   lowest-ranked survivor sends it the module's parameters and buffers, every tracked object's state and the
   step counters, and :meth:`~lightning_ddpx.DistributedDataParallel.verify_replicas` proves every member
   bit-identical before it trains (with a hook that averages parameters, whose replicas differ between
   averages: the newcomers bit-identical to the peer that sent them its replica, and the hook's shared
   state identical on every member).
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddpx.engine.agreement.errors import is_communication_failure
from lightning_ddpx.engine.agreement.replica_check import verify_replicas
from lightning_ddpx.engine.atomic_file import atomic_torch_save
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.fault.commit import ABORT, COMMIT_AND_ADMIT, vote
from lightning_ddpx.fault.hook_state import HookState
from lightning_ddpx.fault.launch_env import LaunchInfo, connect, launch_info_from_environment
from lightning_ddpx.fault.membership import FaultToleranceError, Generation, Membership, RunEnded
from lightning_ddpx.fault.options import FaultToleranceOptions
from lightning_ddpx.hooks.post_local_sgd import PostLocalSGDOptions
from lightning_ddpx.hooks.registry import build_comm_hook

__all__ = [
    "SUPPORTED_HOOKS",
    "FaultTolerance",
    "FaultToleranceStats",
    "RunEnded",
    "StepOutcome",
    "check_post_local_sgd_options",
    "refuse_unsupported_hook",
]

log = logging.getLogger("lightning_ddpx.fault")

_Result = TypeVar("_Result")

# why a member whose own collectives succeeded discards a step: the vote does not say who aborted
_ANOTHER_ABORTED = "another member's collectives failed, or a member was lost before voting"

# Hooks that follow a membership change: the stateless ones (their only state is the default group, which
# each membership rebuilds), PowerSGD, whose shared state is rolled back and handed on, and DiLoCo and
# post-local SGD, whose averaging is snapshotted, voted on and retried over the survivors
# (lightning_ddpx.fault.hook_state); their newcomers are healed as copies of a live replica.
SUPPORTED_HOOKS = (
    "allreduce",
    "bf16",
    "fp16",
    "noop",
    "powersgd",
    "batched_powersgd",
    "diloco",
    "post_local_sgd",
)


@dataclass
class StepOutcome:
    """What :meth:`FaultTolerance.step` decided for one step."""

    committed: bool = False  # every member's collectives succeeded: apply the step
    error: str | None = None  # this member's failure, if it had one (its first line)


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


class FaultTolerance:
    """One training process's part in a fault-tolerant run (see the module's docstring)."""

    def __init__(
        self,
        options: FaultToleranceOptions | bool | dict | None = True,
        *,
        launch: LaunchInfo | None = None,
        backend: str = "gloo",
    ) -> None:
        self.options = FaultToleranceOptions.of(options) or FaultToleranceOptions()
        if backend != "gloo":
            raise ValueError(
                f"lightning_ddpx fault tolerance: backend {backend!r} is not supported yet; only 'gloo' rebuilds "
                "its groups after a lost rank (NCCL needs its communicators aborted)."
            )
        self.backend = backend
        self.launch = launch if launch is not None else launch_info_from_environment()
        self.uid = self.launch.uid
        timeout = timedelta(seconds=self.options.join_timeout_s)
        self.store = connect(self.launch, timeout)
        self.membership = Membership(
            self.store,
            self.uid,
            heartbeat_timeout_s=self.options.heartbeat_timeout_s,
            join_timeout_s=self.options.join_timeout_s,
            min_ranks=self.options.min_ranks,
            connect=lambda: connect(self.launch, timeout),
        )
        self.stats = FaultToleranceStats()
        self.model: DistributedDataParallel | None = None
        self._hook: tuple[Any, Any] | None = None  # (state, hook) from wrap(comm_hook=...)
        self._hook_state = HookState(None)  # its state across discarded steps and new generations
        self._pending_hook_shared: dict[str, Any] | None = None  # received before the hook existed
        self._checked = False  # the model's set-up refused or accepted, at the first step
        self._tracked: list[Any] = []
        self.steps_committed = 0
        self._attempt = 0  # step attempts in this generation (the vote's key)
        self._agreements = 0  # agree() calls in this generation (the agreements' keys)
        self._pending: str | None = None  # why the membership must change at the next boundary
        self._admission_waiting = False  # a committed step saw joiners waiting: admit them when allowed
        self._skip_transfer = False  # the next heal only verifies (this process's state is already there)
        self._stepping = False  # inside step(): collectives' failures are the step's
        self._failed_at: float | None = None
        self._dump_state: Callable[[], dict[str, Any]] = self.state_dict  # what a newcomer receives...
        self._load_state: Callable[[dict[str, Any]], None] = self.load_state_dict  # ... and how it loads it
        self.generation_listeners: list[Callable[[Generation], None]] = []  # told of each new generation
        self.membership.register()
        generation = self.membership.wait_for_admission(self.launch.initial_world_size)
        self._enter(generation)
        self._heal_due = True  # the first boundary heals: from rank 0 at the start, else from a survivor

    # ------------------------------------------------------------------------------------ public API
    @property
    def rank(self) -> int:
        """This process's rank in the current generation (changes when the membership does)."""
        return self.generation.rank_of(self.uid)

    @property
    def world_size(self) -> int:
        return len(self.generation.members)

    @property
    def comm_hook_state(self) -> Any:
        """The state of the hook registered by :meth:`wrap`/:meth:`attach` (``None`` without one)."""
        return self._hook[0] if self._hook is not None else None

    def wrap(
        self,
        module: nn.Module,
        *,
        comm_hook: str | None = None,
        comm_wrapper: str | None = None,
        powersgd: Any = None,
        diloco: Any = None,
        post_local_sgd: Any = None,
        **ddp_options: Any,
    ) -> DistributedDataParallel:
        """``module`` in our :class:`~lightning_ddpx.DistributedDataParallel` over the current members, with
        the communication hook named ``comm_hook`` (one of :data:`SUPPORTED_HOOKS`, optionally cast by
        ``comm_wrapper``: ``"fp16"``/``"bf16"``; ``powersgd``, ``diloco``, ``post_local_sgd``: the hook's options, as its options
        type or a dict). No collective here: the first :meth:`step` makes the replicas
        equal (rank 0's at the start, a survivor's for a newcomer)."""
        for refused in ("process_group", "init_sync"):
            if refused in ddp_options:
                raise ValueError(
                    f"lightning_ddpx fault tolerance: wrap() sets {refused} itself (the group changes with the "
                    "membership; the replicas are made equal at the first step)."
                )
        _check_hook(comm_hook, comm_wrapper)
        if self.model is not None:
            raise RuntimeError(
                "lightning_ddpx fault tolerance: wrap() was already called; one model per run."
            )
        model = DistributedDataParallel(module, init_sync=False, **ddp_options)
        return self.attach(
            model,
            comm_hook=comm_hook,
            comm_wrapper=comm_wrapper,
            powersgd=powersgd,
            diloco=diloco,
            post_local_sgd=post_local_sgd,
        )

    def attach(
        self,
        model: DistributedDataParallel,
        *,
        comm_hook: str | None = None,
        comm_wrapper: str | None = None,
        powersgd: Any = None,
        diloco: Any = None,
        post_local_sgd: Any = None,
        synchronized: bool = False,
    ) -> DistributedDataParallel:
        """Make ``model``, built by the caller over the current generation's group, the run's model (what
        :meth:`wrap` does after building it; the Lightning strategies build theirs from their options) and
        register the named hook on it. ``synchronized=True``: its construction already made the first
        generation's replicas equal (``init_sync``), so the first step only verifies them."""
        _check_hook(comm_hook, comm_wrapper)
        if self.model is not None:
            raise RuntimeError(
                "lightning_ddpx fault tolerance: a model is already attached; one model per run."
            )
        _check_averaging_options(comm_hook, post_local_sgd)  # before post-local SGD makes subgroups
        if comm_hook is not None:
            given = {"powersgd": powersgd, "diloco": diloco, "post_local_sgd": post_local_sgd}
            options = {name: value for name, value in given.items() if value is not None}
            hook = build_comm_hook(comm_hook, wrapper=comm_wrapper, **options)
            model.register_comm_hook(*hook)
            self._hook, self._hook_state = hook, HookState(hook[0])
            self._hook_state.load_shared(self._pending_hook_shared)
            self._pending_hook_shared = None
        self.model = model
        model.failure_report_wait_s = 0.0  # a lost rank writes no final record: do not wait for one
        if synchronized and self.generation.number == 1 and self._heal_due:
            self._skip_transfer = True
        return model

    def use_state(self, dump: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """Replace what a newcomer receives (by default :meth:`state_dict`, loaded by
        :meth:`load_state_dict`): ``dump()`` runs on the live peer that sends, ``load(state)`` on each
        newcomer. The Lightning strategies send a whole Lightning checkpoint (loops, callbacks, loggers)."""
        self._dump_state, self._load_state = dump, load

    def receive_state(self) -> bool:
        """A newcomer receives its state now, before its model exists, instead of at its first step (the
        members send it when they admit it); returns whether this process is such a newcomer. The first step
        then only verifies the replicas. Call right after construction, or never."""
        if self.generation.number == 1 or self.uid not in self.generation.newcomers:
            return False
        while True:
            try:
                if self._pending is not None:
                    self._regroup(self._pending, admit=True)
                    self._pending = None
                self._transfer()
                self._skip_transfer = True
                return True
            except Exception as error:  # noqa: BLE001 - communication failures regroup; others propagate
                if not is_communication_failure(error):
                    raise
                self._pending = f"a member was lost while this newcomer was healed ({_first_line(error)})"
                _forget_frames(error)

    def track(self, *objects: Any) -> None:
        """Objects whose ``state_dict()`` a newcomer receives and loads (optimizers, LR schedulers...), in
        the same order on every process."""
        for obj in objects:
            if not (
                callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            ):
                raise TypeError(
                    f"lightning_ddpx fault tolerance: track() takes objects with state_dict() and "
                    f"load_state_dict(), got {type(obj).__name__}."
                )
            self._tracked.append(obj)

    @contextlib.contextmanager
    def step(self, admit: bool = True) -> Iterator[StepOutcome]:
        """One training step's forward and backward, at a step boundary. A membership change decided by the
        last step is applied first (a new group; newcomers healed, unless ``admit=False``: then waiting
        newcomers are admitted at a later boundary that allows it). A communication failure inside is caught
        and voted on; apply the step (``optimizer.step()``) only if ``outcome.committed``. Every member passes
        the same ``admit`` at the same step."""
        if self.model is None:
            raise RuntimeError("lightning_ddpx fault tolerance: call wrap(module) before the first step().")
        if self.model.inside_join:  # every member alike, before any collective of the step
            raise ValueError(
                "lightning_ddpx fault tolerance: model.join() (uneven inputs) is not supported: a joined rank "
                "shadows the others' collectives outside the steps the members agree on, and a membership "
                "change would leave its count stale. Key the data on ft.steps_committed, ft.rank and "
                "ft.world_size instead: every member then runs the same steps, and a lost rank's share goes "
                "to the survivors."
            )
        if not self._checked:
            _refuse_unsupported(self.model, self._hook is not None)
            self._checked = True
        # with parameter averaging the replicas differ between syncs: newcomers join after one
        self._at_boundary(admit and self.model.parameter_averaging is None)
        self._hook_state.before_step()
        outcome = StepOutcome()
        self._stepping = True
        try:
            yield outcome
        except Exception as error:  # noqa: BLE001 - only communication failures are voted on; others re-raised
            outcome.error = self._failure_to_vote(error)
            if outcome.error is None:
                raise
            del error
            self._release_group()  # peers still blocked on this member in the failed step fail at once
        finally:
            self._stepping = False
        self._attempt += 1
        decision = self._vote(outcome.error is None)
        outcome.committed = decision != ABORT
        if outcome.committed:
            self.steps_committed += 1
            self._recovered()
            if decision == COMMIT_AND_ADMIT:
                self._admission_waiting = True
        else:
            self._hook_state.after_discarded_step()  # the same shared hook state on every member again
            self.stats.failures += 1
            self._failed_at = self._failed_at or time.monotonic()
            cause = outcome.error if outcome.error is not None else _ANOTHER_ABORTED
            self._note(
                f"step {self.steps_committed} discarded on every member of generation "
                f"{self.generation.number} ({cause})"
            )
            self._pending = f"step {self.steps_committed} failed"

    def boundary(self, admit: bool = True) -> None:
        """A step boundary without a step (the Lightning strategies call it at each epoch's start): apply a
        pending membership change -- admitting waiting newcomers if ``admit`` -- then agree, through the
        store, that every member reached this point in the same generation (a member lost or gone ahead to a
        new generation makes another one first). Every member calls it at the same point."""
        if self.model is None:
            raise RuntimeError("lightning_ddpx fault tolerance: call wrap(module) before boundary().")
        while True:
            self._at_boundary(admit)
            self._attempt += 1
            decision = self._vote(ok=True)
            if decision == ABORT:
                self._pending = "a member was lost at a boundary"
            elif decision == COMMIT_AND_ADMIT and admit:
                self._admission_waiting = True
            else:
                return

    def prepare_step(self) -> None:
        """Apply a membership change decided since the last step now, before a step whose work begins
        before :meth:`step` (the Trainer's gradient accumulation: micro-batches that accumulate locally,
        then one that synchronises inside ``step()``), so that all of it runs in the new group. Every
        member calls it at the same point. Newcomers are not admitted here."""
        self._at_boundary(admit=False)

    @property
    def in_sync(self) -> bool:
        """Whether a collective outside a step runs now (:meth:`outside_step`): this process's replica has
        been verified equal to the others' (a newcomer's has not, before its first boundary, and nor has
        anyone's before the run's first)."""
        return not self._heal_due and dist.is_initialized()

    def outside_step(
        self, run: Callable[[], _Result], fallback: Callable[[], _Result], retry: bool = True
    ) -> _Result:
        """``run()``, a collective between steps (a logged metric's reduction, a checkpoint's broadcast, a
        torchmetrics sync), with one answer on every member. Every member calls it at the same points.

        Each call is voted on, as a step is: a member lost during the collective can leave one survivor with
        the whole result and another with an error, and a value that differs between the members (each one's
        own ``val_loss``) would split what it decides (a ``ReduceLROnPlateau``, a checkpoint's top-k). When any
        member's collective failed, every member regroups at once over the members present and, with
        ``retry`` (the default), runs ``run()`` again there: the answer is the survivors' reduction, the same
        on every member. Without ``retry`` (work that must not run twice: a micro-batch's forward)
        ``fallback()`` answers on every member instead. ``fallback()`` also answers, with no collective,
        before this process's replica was first verified equal to the others' (a newcomer before its first
        boundary, or anyone before the run's first). A membership change still pending from a failed step is
        applied first, so the collective runs over the members present."""
        if self._stepping:
            return run()  # inside a step: a failure is the step's, voted on by step()
        if not self.in_sync:
            return fallback()
        while True:
            self._at_boundary(admit=False)  # a failed step's regroup, before the collective
            result, decision, error = self._run_voted(run)
            if decision != ABORT:
                return result  # type: ignore[return-value]
            if error is None:
                self._release_group()
            self._failed_at = self._failed_at or time.monotonic()
            cause = error if error is not None else _ANOTHER_ABORTED
            self._pending = f"a collective between steps failed ({cause})"
            self._note(
                f"{self._pending}; every member regroups now"
                + (" and runs it again" if retry else ", each with its own answer to it")
            )
            if not retry:
                self._at_boundary(admit=False)
                return fallback()

    def agree(self, decision: bool) -> bool:
        """``decision``, taken between steps from a collective that may have failed on some members and not
        on others (a reduced boolean: early stopping's), made one decision on every member: the first
        member's to reach the store. Every member calls it at the same points, in the same order."""
        self._agreements += 1
        agreed = self.membership.agree(self.generation, self._agreements, "1" if decision else "0")
        return agreed == "1"

    def average_after_step(self, optimizers: Any = None, admit: bool = True) -> bool:
        """After each applied ``optimizer.step()`` of a model whose hook averages parameters (DiLoCo,
        post-local SGD), instead of ``model.average_parameters_after_step()``: counts the step, and when the
        outer step (the average) is due, runs it fault-tolerantly. The parameters and the hook's state are
        snapshotted first; if a member is lost during the exchange, every member puts both back, the
        survivors regroup and run it again among themselves (the lost replica's local steps are lost, theirs
        are not). Right after an average waiting newcomers are admitted and healed, as copies of the peer
        that sends them its replica, unless ``admit=False`` (the Trainer admits at an epoch's start only).
        Returns whether the parameters changed."""
        model = self.model
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
                self._at_boundary(admit)  # waiting newcomers join here (the Trainer: at an epoch's start)
                return bool(changed)
            with torch.no_grad():
                for param, saved in zip(params, saved_params):
                    param.copy_(saved)
            averaging.load_state_dict(saved_state)
            self.stats.failures += 1
            self._failed_at = self._failed_at or time.monotonic()
            cause = error if error is not None else _ANOTHER_ABORTED
            self._note(
                f"{averaging.name} after step {self.steps_committed} failed on generation "
                f"{self.generation.number} ({cause}); every member put its parameters back, the survivors "
                "run it again"
            )
            self._pending = "an outer step failed"
            self._at_boundary(admit=False)

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
        self._attempt += 1
        decision = self._vote(error is None)
        if decision != ABORT:
            self._recovered()  # a failed section rerun: the survivors are going again
            self._admission_waiting = self._admission_waiting or decision == COMMIT_AND_ADMIT
        return result, decision, error

    def _vote(self, ok: bool) -> str:
        """This member's vote on attempt ``self._attempt`` (:func:`~lightning_ddpx.fault.commit.vote`); a
        member that does not vote within ``collective_timeout_s`` aborts the attempt, as a silent peer fails
        a collective."""
        return vote(
            self.store, self.membership, self.generation, self._attempt, ok, self.options.collective_timeout_s
        )

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
        _forget_frames(error)
        return _first_line(error)

    def _release_group(self) -> None:
        """Destroy the current group now that this member's step failed: in a ring all-reduce a survivor may
        be waiting for data from another survivor that has already left the step; once the group's last
        reference is gone its connections close, and that receive fails at once instead of after the
        collective timeout (``ProcessGroup.abort()`` does not close gloo's). Rebuilt at the next boundary."""
        if self.model is not None:
            self.model.release_process_group()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # a reference cycle through a failed future must not keep the connections open

    def _abandon_step(self) -> None:
        """An error of the user's inside :meth:`step`: vote ``abort`` so that the others discard the step and
        regroup (without this process if it exits), then let the error propagate."""
        self._attempt += 1
        try:
            self._vote(ok=False)
        except Exception:  # noqa: BLE001 - the store is gone: the user's error is the one to report
            pass
        self._pending = f"process {self.uid} raised inside step()"

    def close(self) -> None:
        """Leave the run: stop the heartbeat, close the module; the process group is destroyed."""
        self.membership.leave(self.generation)
        self.membership.close()
        if self.model is not None:
            self.model.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ----------------------------------------------------------------------------------- boundaries
    def _at_boundary(self, admit: bool) -> None:
        """Apply a membership change decided by the last step (with the waiting newcomers if ``admit``); a
        member lost meanwhile (while the group was rebuilt or a newcomer healed) makes another one."""
        while self._pending is not None or self._heal_due or (admit and self._admission_waiting):
            try:
                if self._pending is not None or (admit and self._admission_waiting):
                    self._regroup(self._pending or "newcomers waiting", admit)
                    self._pending = None
                    self._admission_waiting = self._admission_waiting and not admit
                if self._heal_due:
                    self._heal()
                    self._heal_due = False
            except Exception as error:  # noqa: BLE001 - communication failures regroup; others propagate
                if not is_communication_failure(error):
                    raise
                self._pending = f"a member was lost while the membership changed ({_first_line(error)})"
                _forget_frames(error)  # its frames would keep the failed group's connections open

    def _regroup(self, reason: str, admit: bool) -> None:
        if self.model is not None:
            self.model.release_process_group()  # the old group's connections close when it is destroyed
        # A group released while its step's error was handled may still have been held then: the frames of
        # that error's traceback (the caller's ``with`` holds it until the block ends) keep the reducer's
        # gradient hooks, and through them the group. They are gone now; collect the cycle, so that its
        # connections close before this member waits for the others (who may be blocked on it until then).
        gc.collect()
        current = self.generation
        while True:
            generation = self.membership.next_generation(current, reason, admit_joiners=admit)
            try:
                self._enter(generation)
                break
            except RuntimeError as error:  # a member of the record did not arrive: it was lost meanwhile
                if not is_communication_failure(error) and "timeout" not in str(error).lower():
                    raise
                current, reason = generation, f"a member of generation {generation.number} did not arrive"
        if self.model is not None:
            self.model.use_process_group(dist.group.WORLD, comm_hook=self._hook)
        self._hook_state.after_regroup()
        self._heal_due = bool(generation.newcomers)
        self._skip_transfer = False  # a newcomer healed early takes part again: the sources send again

    def _enter(self, generation: Generation) -> None:
        """Build the default process group of ``generation`` (rank = place in its member list)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation = generation
        self._attempt = 0
        self._agreements = 0
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"ft/gen/{generation.number}/pg/", self.store),
            rank=generation.rank_of(self.uid),
            world_size=len(generation.members),
            timeout=timedelta(seconds=self.options.collective_timeout_s),
        )
        self.stats.generation, self.stats.world_size = generation.number, len(generation.members)
        self.stats.members_lost += len(generation.lost)
        lost = f"; lost {', '.join(generation.lost)}" if generation.lost else ""
        joined = [uid for uid in generation.newcomers if generation.number > 1]
        admitted = f"; admitted {', '.join(joined)}" if joined else ""
        self._note(
            f"generation {generation.number}: {len(generation.members)} rank(s) {list(generation.members)} "
            f"({generation.reason}{lost}{admitted}); this process is rank {generation.rank_of(self.uid)}"
        )
        for listener in self.generation_listeners:
            listener(generation)

    # ----------------------------------------------------------------------------------------- heal
    def _heal(self) -> None:
        """Send the newcomers the state of the lowest-ranked member that was there before (rank 0 at the
        start) unless they have it already, then prove every replica equal. Every member takes part."""
        assert self.model is not None
        started = time.monotonic()
        size = None if self._skip_transfer else self._transfer()
        self._skip_transfer = False
        self._verify_healed()
        self.membership.mark_healthy()
        generation = self.generation
        if generation.number > 1:
            self.stats.newcomers_healed += len(generation.newcomers)
            self.stats.last_heal_s = time.monotonic() - started
            sent = f" ({size / 2**20:.1f} MiB)" if size is not None else ""
            self._note(
                f"healed {', '.join(generation.newcomers)} from {min(generation.previous)} in "
                f"{self.stats.last_heal_s:.2f} s{sent}; replicas verified"
            )

    def _verify_healed(self) -> None:
        """Prove the heal: every member's replica bit-identical (parameters and buffers), and the hook's
        shared state (PowerSGD's warm start, DiLoCo's anchors and outer momentum) identical on every member.
        With a hook that averages parameters (DiLoCo, post-local SGD) the replicas differ between averages by
        design, and the Trainer admits at an epoch's start: the newcomers are then proved copies of the peer
        that sent them its replica. Every member decides alike (from the generation and the hook)."""
        assert self.model is not None
        generation = self.generation
        among = None
        if self.model.parameter_averaging is not None:
            among = [self._source_rank()] + [generation.rank_of(uid) for uid in generation.newcomers]
        if self.model.broadcast_buffers:
            # Buffers a forward updates (BatchNorm's running statistics) differ between the members after
            # every step, as under torch's DDP, until the next forward broadcasts one rank's: do it now,
            # from the peer the newcomers copied, so that the check below compares what will train.
            self.model.synced_buffers.broadcast(dist.group.WORLD, self._source_rank())
        self.model.verify_replicas(buffers=True, what="after a newcomer was healed", among=among)
        shared = _named_tensors("the hook's shared state", self.hook_state_dict())
        if shared:
            verify_replicas(
                shared, dist.group.WORLD, self.model.synchronised_steps, what="after a newcomer was healed"
            )

    def _source_rank(self) -> int:
        """The rank that sends a newcomer its state: the lowest-ranked live peer (rank 0 at the start)."""
        generation = self.generation
        return generation.rank_of(min(generation.previous or generation.members[:1]))

    def _transfer(self) -> int:
        """The lowest-ranked live peer's state to every member (a collective); the newcomers load it.
        Returns its size in bytes."""
        generation = self.generation
        source = self._source_rank()
        payload = self._state() if self.rank == source else None
        state = _broadcast_bytes(payload, source)
        if self.uid in generation.newcomers and self.rank != source:
            self._load(state)
        return len(state)

    # ---------------------------------------------------------------------------------- the state
    def state_dict(self) -> dict[str, Any]:
        """What a newcomer receives and a checkpoint holds: the module's parameters and buffers, every
        tracked object's state, the hook's shared state (PowerSGD's; not its per-rank error feedback), the
        step counter, and (for the record) the membership that saved it."""
        assert self.model is not None, "call wrap(module) first"
        return {
            "module": self.model.module.state_dict(),
            "tracked": [obj.state_dict() for obj in self._tracked],
            "hook": self.hook_state_dict(),
            "steps_committed": self.steps_committed,
            "membership": {"generation": self.generation.number, "world_size": self.world_size},
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "the live peer") -> None:
        """Load :meth:`state_dict`'s output (``source`` names where it came from, for errors)."""
        assert self.model is not None, "call wrap(module) first"
        if len(state["tracked"]) != len(self._tracked):
            raise FaultToleranceError(
                f"lightning_ddpx fault tolerance: {source} tracks {len(state['tracked'])} object(s) and this "
                f"process {len(self._tracked)}: call track() with the same objects on every process."
            )
        self.model.module.load_state_dict(state["module"])
        for obj, obj_state in zip(self._tracked, state["tracked"]):
            obj.load_state_dict(obj_state)
        self.load_hook_state_dict(state.get("hook"))
        self.steps_committed = int(state["steps_committed"])

    def save_checkpoint(self, path: str | os.PathLike) -> bool:
        """Write :meth:`state_dict` to ``path`` if this process is rank 0 of the current generation (whichever
        process that is after a loss); returns whether it wrote. Atomic and durable
        (:func:`~lightning_ddpx.engine.atomic_file.atomic_torch_save`, the strategies' writer too): a writer
        killed mid-save leaves the previous checkpoint whole. Between steps, on every process alike (no
        collective)."""
        if self.rank != 0:
            return False
        atomic_torch_save(self.state_dict(), path)
        return True

    def load_checkpoint(self, path: str | os.PathLike) -> bool:
        """Resume from :meth:`save_checkpoint`'s file, at any world size: call after :meth:`wrap` and
        :meth:`track`, before the first :meth:`step`, on every process. Only rank 0 of the run's first
        generation reads it; the first step hands its state to every other member (and a replacement admitted
        later is healed from the survivors, never from the file). Returns whether this process loaded it."""
        if not (self._heal_due and self.generation.number == 1 and self.rank == 0):
            return False
        state = torch.load(os.fspath(path), weights_only=True)
        self.load_state_dict(state, source=f"the checkpoint {os.fspath(path)!r}")
        saved = state.get("membership", {})
        self._note(
            f"resumed from {os.fspath(path)!r} at step {self.steps_committed} (saved by a generation of "
            f"{saved.get('world_size', '?')} rank(s); now {self.world_size})"
        )
        return True

    def hook_state_dict(self) -> dict[str, Any] | None:
        """The hook's shared state (PowerSGD's iteration, seed generator, warm-start Q), for a checkpoint;
        ``None`` for a stateless hook."""
        return self._hook_state.shared()

    def load_hook_state_dict(self, shared: dict[str, Any] | None) -> None:
        """Adopt :meth:`hook_state_dict`'s output (a resumed checkpoint's); error feedback starts at zero."""
        if self._hook is None:
            self._pending_hook_shared = shared  # applied when attach() registers the hook
        else:
            self._hook_state.load_shared(shared)

    def _state(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"state": self._dump_state(), "hook": self.hook_state_dict()}, buffer)
        return buffer.getvalue()

    def _load(self, data: bytes) -> None:
        # a custom state (a Lightning checkpoint) may hold objects weights_only refuses; it comes from a peer
        # of the same run, as trusted as a checkpoint the run wrote
        default = self._load_state == self.load_state_dict
        payload = torch.load(io.BytesIO(data), weights_only=default)
        self.load_hook_state_dict(payload["hook"])
        self._load_state(payload["state"])

    def _note(self, message: str) -> None:
        self.stats.events.append(message)
        log.warning("lightning_ddpx fault tolerance (process %s): %s", self.uid, message)


def _forget_frames(error: BaseException) -> None:
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


def refuse_unsupported_hook(comm_hook: Any) -> None:
    """Refuse a hook fault tolerance cannot follow across a membership change: the one message for the
    strategies' options and for :meth:`FaultTolerance.wrap`."""
    if comm_hook is None or (isinstance(comm_hook, str) and comm_hook in SUPPORTED_HOOKS):
        return
    name = (
        comm_hook if isinstance(comm_hook, str) else getattr(comm_hook, "__name__", type(comm_hook).__name__)
    )
    raise ValueError(
        f"lightning_ddpx fault tolerance: comm_hook={name!r} is not supported with fault tolerance; the "
        f"supported hooks are {list(SUPPORTED_HOOKS)} (with or without comm_wrapper); a hook of your own keeps "
        "state the fault tolerance cannot roll back or hand on, and is refused rather than half-working."
    )


def _check_hook(comm_hook: str | None, comm_wrapper: str | None) -> None:
    refuse_unsupported_hook(comm_hook)
    if comm_wrapper is not None and comm_hook is None:
        raise ValueError("lightning_ddpx fault tolerance: comm_wrapper needs a comm_hook to wrap.")


def _check_averaging_options(comm_hook: str | None, post_local_sgd: Any) -> None:
    """Post-local SGD's options (a dict or the options type), refused by name before its subgroups exist.
    Every DiLoCo option is supported (:class:`~lightning_ddpx.fault.hook_state.HookState`)."""
    if comm_hook == "post_local_sgd":
        given = post_local_sgd if post_local_sgd is not None else {}
        options = PostLocalSGDOptions(**given) if isinstance(given, dict) else given
        check_post_local_sgd_options(options.subgroup, options.hierarchy, options.period)


def check_post_local_sgd_options(subgroup: Any, hierarchy: Any, period: Any) -> None:
    """Post-local SGD follows a membership change with ``subgroup=1`` (each rank its own subgroup: the one
    size that divides every world size) or ``subgroup=None`` (the ranks on each machine, found again for
    each membership), no ``hierarchy`` (its groups' sizes are the old world's) and a ``period`` (the
    averages the fault tolerance votes on; averaging by hand it cannot see)."""
    for name, value, wanted, allowed in (
        ("subgroup", subgroup, "subgroup=1 or None (the ranks on each machine)", subgroup in (1, None)),
        ("hierarchy", hierarchy, "no hierarchy", hierarchy is None),
        ("period", period, "a period", period is not None),
    ):
        if not allowed:
            raise ValueError(
                f"lightning_ddpx fault tolerance: post-local SGD with {name}={value!r} is not supported; use "
                f"{wanted} (a membership change leaves other subgroups and hierarchies stale, and averages "
                "made by hand are not voted on)."
            )


def _refuse_unsupported(model: DistributedDataParallel, hook_from_wrap: bool) -> None:
    """What cannot survive a membership change, refused by name before the first step."""
    reducer = model.reducer
    if reducer.hook_registered and not hook_from_wrap:
        raise ValueError(
            f"lightning_ddpx fault tolerance: the model has a communication hook ({reducer.transport.name}) "
            f"registered outside wrap(); pass comm_hook= to wrap() (supported: {list(SUPPORTED_HOOKS)})."
        )
    if reducer.overlap is not None or reducer.in_backward is not None:
        raise ValueError(
            "lightning_ddpx fault tolerance: the optimizer overlap (or an optimizer in backward) updates "
            "parameters during backward, before the members agree whether the step counts, so a discarded "
            "step could not be undone; train without it."
        )


def _named_tensors(prefix: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors and numbers in a (nested) state dict, named by their path, in a fixed order: what the
    replica check compares. Strings and ``None`` carry no training state and are left out."""
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, (bool, int)):
        return [(prefix, torch.tensor(int(value), dtype=torch.int64))]
    if isinstance(value, float):
        return [(prefix, torch.tensor(value, dtype=torch.float64))]
    items: list[tuple[Any, Any]] = []
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: str(item[0]))
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    return [named for key, item in items for named in _named_tensors(f"{prefix}[{key!r}]", item)]


def _broadcast_bytes(payload: bytes | None, source: int) -> bytes:
    """``payload`` from rank ``source`` to every rank of the default group (two broadcasts: size, bytes)."""
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, source)
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload is not None
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(data, source)
    return payload if payload is not None else data.numpy().tobytes()


def _first_line(cause: Any) -> str:
    text = str(cause).strip().splitlines()
    return text[0][:200] if text else type(cause).__name__
