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
import os
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from lightning_ddpx.engine.atomic_file import atomic_torch_save
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.fault.checks import (
    SUPPORTED_HOOKS,
    check_attached_hook,
    check_averaging_options,
    check_backend,
    check_hook,
    check_post_local_sgd_options,
    check_trackable,
    check_wrap_options,
    refuse_unsupported_hook,
)
from lightning_ddpx.fault.generations import Generations
from lightning_ddpx.fault.heal import Healer
from lightning_ddpx.fault.hook_state import HookState
from lightning_ddpx.fault.launch_env import LaunchInfo, launch_info_from_environment
from lightning_ddpx.fault.membership import FaultToleranceError, Generation, RunEnded
from lightning_ddpx.fault.options import FaultToleranceOptions
from lightning_ddpx.fault.phases import MemberPhase
from lightning_ddpx.fault.stats import FaultToleranceStats
from lightning_ddpx.fault.steps import Replica, StepOutcome, StepProtocol
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

_Result = TypeVar("_Result")


class FaultTolerance:
    """One training process's part in a fault-tolerant run (see the module's docstring): the model and the
    state a newcomer receives, over three collaborators -- :attr:`generations` (the membership and its
    process groups), the :class:`~lightning_ddpx.fault.heal.Healer` (state to newcomers, behind a
    :class:`~lightning_ddpx.fault.transport.StateTransport`) and :attr:`protocol` (the votes, the phases,
    the boundaries; the Lightning adapter drives its Trainer-shaped entry points directly)."""

    def __init__(
        self,
        options: FaultToleranceOptions | bool | dict | None = True,
        *,
        launch: LaunchInfo | None = None,
        backend: str = "gloo",
    ) -> None:
        self.options = FaultToleranceOptions.of(options) or FaultToleranceOptions()
        check_backend(backend)
        self.backend = backend
        self.launch = launch if launch is not None else launch_info_from_environment()
        self.uid = self.launch.uid
        self.stats = FaultToleranceStats()
        self.generations = Generations(self.options, self.launch, backend, self.stats, self._note)
        self.store, self.membership = self.generations.store, self.generations.membership
        self.generation_listeners = self.generations.listeners  # told of each new generation
        self._replica = Replica()
        self._pending_hook_shared: dict[str, Any] | None = None  # received before the hook existed
        self._tracked: list[Any] = []
        self.healer = Healer(
            self.state_dict, self.load_state_dict, self.hook_state_dict, self.load_hook_state_dict
        )
        self.protocol = StepProtocol(self.generations, self.healer, self._replica, self.stats, self._note)
        self.generations.join()  # the first boundary heals: from rank 0 at the start, else from a survivor

    # ------------------------------------------------------------------------------------ public API
    @property
    def generation(self) -> Generation:
        """The current generation (its number, members, newcomers)."""
        return self.generations.current

    @property
    def rank(self) -> int:
        """This process's rank in the current generation (changes when the membership does)."""
        return self.generations.rank

    @property
    def world_size(self) -> int:
        return len(self.generations.current.members)

    @property
    def model(self) -> DistributedDataParallel | None:
        """The run's model, once :meth:`wrap` or :meth:`attach` made it."""
        return self._replica.model

    @property
    def steps_committed(self) -> int:
        """Steps every member applied (a discarded one does not count): key the data order on it."""
        return self.protocol.steps_committed

    @steps_committed.setter
    def steps_committed(self, value: int) -> None:
        self.protocol.steps_committed = value

    @property
    def comm_hook_state(self) -> Any:
        """The state of the hook registered by :meth:`wrap`/:meth:`attach` (``None`` without one)."""
        return self._replica.hook[0] if self._replica.hook is not None else None

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
        ``comm_wrapper``: ``"fp16"``/``"bf16"``; ``powersgd``, ``diloco``, ``post_local_sgd``: the hook's
        options, as its options type or a dict), built by the hook registry
        (:func:`~lightning_ddpx.hooks.build_comm_hook`, the strategies' route too). No collective here: the
        first :meth:`step` makes the replicas equal (rank 0's at the start, a survivor's for a newcomer)."""
        check_wrap_options(ddp_options)
        check_hook(comm_hook, comm_wrapper)
        self._refuse_second_model()
        check_averaging_options(comm_hook, post_local_sgd)  # before post-local SGD makes subgroups
        model = DistributedDataParallel(module, init_sync=False, **ddp_options)
        if comm_hook is not None:
            given = {"powersgd": powersgd, "diloco": diloco, "post_local_sgd": post_local_sgd}
            options = {name: value for name, value in given.items() if value is not None}
            model.register_comm_hook(*build_comm_hook(comm_hook, wrapper=comm_wrapper, **options))
        return self.attach(model, comm_hook=comm_hook)

    def attach(
        self, model: DistributedDataParallel, *, comm_hook: str | None = None, synchronized: bool = False
    ) -> DistributedDataParallel:
        """Make ``model``, built by the caller over the current generation's group with the hook named
        ``comm_hook`` already registered (the Lightning strategies build both from their options, through
        ``DDPXConfig.register_hook``), the run's model; its hook then follows the membership.
        ``synchronized=True``: its construction already made the first generation's replicas equal
        (``init_sync``), so the first step only verifies them."""
        self._refuse_second_model()
        check_attached_hook(model, comm_hook)
        if comm_hook is not None:
            hook = (model.comm_hook_state, model.comm_hook)
            self._replica.hook, self._replica.hook_state = hook, HookState(hook[0])
            self._replica.hook_state.load_shared(self._pending_hook_shared)
            self._pending_hook_shared = None
        self._replica.model = model
        model.failure_report_wait_s = 0.0  # a lost rank writes no final record: do not wait for one
        phases = self.protocol.phases
        if synchronized and self.generation.number == 1 and phases.current is MemberPhase.HEAL_DUE:
            phases.move(MemberPhase.VERIFY_DUE)
        return model

    def _refuse_second_model(self) -> None:
        if self._replica.model is not None:
            raise RuntimeError(
                "lightning_ddpx fault tolerance: a model is already attached; one model per run."
            )

    def track(self, *objects: Any) -> None:
        """Objects whose ``state_dict()`` a newcomer receives and loads (optimizers, LR schedulers...), in
        the same order on every process."""
        for obj in objects:
            check_trackable(obj)
            self._tracked.append(obj)

    def step(self, admit: bool = True) -> contextlib.AbstractContextManager[StepOutcome]:
        """One training step's forward and backward, at a step boundary. A membership change decided by the
        last step is applied first (a new group; newcomers healed, unless ``admit=False``: then waiting
        newcomers are admitted at a later boundary that allows it). A communication failure inside is caught
        and voted on; apply the step (``optimizer.step()``) only if ``outcome.committed``. Every member passes
        the same ``admit`` at the same step."""
        return self.protocol.step(admit)

    @property
    def in_sync(self) -> bool:
        """Whether a collective outside a step runs now (:meth:`outside_step`): this process's replica has
        been verified equal to the others' (a newcomer's has not, before its first boundary, and nor has
        anyone's before the run's first)."""
        return self.protocol.in_sync

    @property
    def inside_step(self) -> bool:
        """Inside :meth:`step`: a collective's failure is the step's."""
        return self.protocol.inside_step

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
        return self.protocol.outside_step(run, fallback, retry)

    def average_after_step(self, optimizers: Any = None, admit: bool = True) -> bool:
        """After each applied ``optimizer.step()`` of a model whose hook averages parameters (DiLoCo,
        post-local SGD), instead of ``model.average_parameters_after_step()``: counts the step, and when the
        outer step (the average) is due, runs it fault-tolerantly. The parameters and the hook's state are
        snapshotted first; if a member is lost during the exchange, every member puts both back, the
        survivors regroup and run it again among themselves (the lost replica's local steps are lost, theirs
        are not). Right after an average waiting newcomers are admitted and healed, as copies of the peer
        that sends them its replica, unless ``admit=False`` (the Trainer admits at an epoch's start only).
        Returns whether the parameters changed."""
        return self.protocol.average_after_step(optimizers, admit)

    def close(self) -> None:
        """Leave the run: stop the heartbeat, close the module; the process group is destroyed."""
        self.generations.close()
        if self.model is not None:
            self.model.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

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
        if not (self.protocol.phases.heal_due and self.generation.number == 1 and self.rank == 0):
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
        return self._replica.hook_state.shared()

    def load_hook_state_dict(self, shared: dict[str, Any] | None) -> None:
        """Adopt :meth:`hook_state_dict`'s output (a resumed checkpoint's); error feedback starts at zero."""
        if self._replica.hook is None:
            self._pending_hook_shared = shared  # applied when attach() registers the hook
        else:
            self._replica.hook_state.load_shared(shared)

    def _note(self, message: str) -> None:
        self.stats.note(self.uid, message)
