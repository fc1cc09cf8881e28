"""``fault_tolerance`` in a Lightning training process: a lost rank does not end ``trainer.fit``.

With ``fault_tolerance`` the Trainer strategy's run is a :class:`FaultTolerantTrainerRun` (the
:class:`~lightning_ddpx.lightning.runs.trainer_run.TrainerRun` whose seams are where a lost rank matters) and the
Fabric strategy's a :class:`FaultTolerantFabricRun` (its loop steps through ``FaultTolerance`` itself); the
protocol (membership, votes, heals) is :class:`~lightning_ddpx.fault.FaultTolerance`'s. The rules both
strategies follow are written once here: the gloo check (:func:`check_backend`), the cluster environment,
the hook handed to the fault tolerance (:func:`attach_hook`), the membership record in checkpoints
(:func:`membership_record`); the options refused are
:func:`~lightning_ddpx.lightning.settings.fault_tolerance_options.check_options`'s. For the Trainer:

- **Steps.** Each optimizer step's closure (forward and backward) runs inside ``FaultTolerance.step()``; the
  optimizer steps only if every member's collectives succeeded. A discarded step counts like a step whose
  update was skipped (as AMP's inf/NaN check skips one): ``global_step`` moves, that batch's update is lost on
  every member, and the loop goes on with the next batch. A membership change is applied at the start of
  the optimizer step's first batch (:meth:`FaultTolerantTrainerRun.begin_batch`): with
  ``accumulate_grad_batches=k`` the k-1 micro-batches that accumulate locally run between steps (a
  collective in them, a buffer broadcast or a synced log, fails that member's step alone), and the k-th
  synchronises inside ``step()``.
- **Averages.** With DiLoCo or post-local SGD the average after a step (an outer step, a fragment's sync)
  runs through ``FaultTolerance.average_after_step``: snapshotted, voted on, put back and rerun over the
  survivors.
- **Epoch boundaries.** At each training epoch's start (when the fit loop sets the samplers' epoch, or at its
  first batch without a sampler) the members pass :meth:`StepProtocol.boundary <lightning_ddpx.fault.steps.StepProtocol.boundary>`: replacements waiting are
  admitted there, and only there, because that is where a Lightning checkpoint resumes exactly. The
  lowest-ranked live peer sends the newcomer what ``trainer.save_checkpoint`` would write (module,
  optimizers, schedulers, loops, callbacks, precision), which the newcomer's ``fit`` restores as from
  ``ckpt_path``; the replicas are then verified bit-identical (with DiLoCo or post-local SGD, whose
  replicas differ there, the newcomer is verified a copy of the replica that sent it). The
  ``DistributedSampler`` of each training loader is resharded over the new membership there, so from the
  next epoch on every sample is seen once per epoch; within the epoch of a loss, the lost rank's remaining
  share is skipped. The members' batch counts are compared there too.
- **Between steps.** Lightning's barriers are no-ops; its broadcasts, reductions and gathers between steps
  (checkpoint paths, ``self.log(sync_dist=True)`` in validation, early stopping's decision) give this
  process's own value when the group failed, and the membership changes at the next step; so do the
  syncs of the LightningModule's torchmetrics metrics
  (:mod:`~lightning_ddpx.lightning.fault_tolerance.metrics`).
- **Ranks.** ``trainer.global_rank``/``world_size`` and ``rank_zero_only`` follow the membership: after rank 0
  is lost, the new rank 0 logs and writes checkpoints, into the same logger version (pinned at the start).
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.fault.checks import check_backend as refuse_backend
from lightning_ddpx.fault.manager import FaultTolerance
from lightning_ddpx.fault.membership import FaultToleranceError
from lightning_ddpx.fault.options import FaultToleranceOptions
from lightning_ddpx.lightning import _compat as lightning_compat
from lightning_ddpx.lightning.fault_tolerance.launch import (
    FabricFaultTolerantLauncher,
    FaultTolerantEnvironment,
    FaultTolerantLauncher,
    contain_logger_failures,
    continue_loggers,
    in_training_process,
    join_run,
)
from lightning_ddpx.lightning.fault_tolerance.metrics import MetricSyncGuard
from lightning_ddpx.lightning.fault_tolerance.state import digest, state_digests
from lightning_ddpx.lightning.runs.fabric_run import FabricRun, StrategyView
from lightning_ddpx.lightning.runs.trainer_run import Default, TrainerRun, TrainerStrategyView

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

    from lightning_ddpx.lightning.settings.config import DDPXConfig

__all__ = [
    "CHECKPOINT_KEY",
    "FaultTolerantFabricRun",
    "FaultTolerantTrainerRun",
    "check_trainer",
    "follow_rank",
]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_ddpx_fault_tolerance"  # the membership that saved a checkpoint, for the record
_HANDED_ON_KEY = "lightning_ddpx_handed_on"  # what a newcomer takes beyond the checkpoint (see _handed_on)
_LOGGER_VERSIONS_KEY = "ft/lightning/logger_versions"


def check_backend(backend: str) -> None:
    """Refuse a process group backend whose groups cannot be rebuilt after a lost rank (both strategies):
    fault/'s rule, naming the strategies' option."""
    refuse_backend(backend, who="DDPXStrategy", option="process_group_backend")


def fault_tolerant_environment(given: Optional["ClusterEnvironment"]) -> "ClusterEnvironment":
    """The cluster environment of a fault-tolerant strategy (ranks follow the membership); one given is
    refused (both strategies)."""
    if given is not None:
        raise ValueError(
            f"DDPXStrategy: fault_tolerance brings its own cluster environment (ranks follow the "
            f"membership); got cluster_environment={type(given).__name__}. On several machines, start the "
            "script with python -m lightning_ddpx.fault.launch on each (docs/fault-tolerance.md)."
        )
    return FaultTolerantEnvironment()


def refuse_several_machines(num_nodes: int) -> None:
    """The strategies' own launchers supervise one machine; several start the script with ours on each."""
    if num_nodes > 1 and not in_training_process():
        raise ValueError(
            "DDPXStrategy: with fault_tolerance on several machines, start the script with "
            "python -m lightning_ddpx.fault.launch on each machine (docs/fault-tolerance.md); the strategy's "
            f"own launcher supervises one machine (num_nodes={num_nodes})."
        )


def attach_hook(fault: FaultTolerance, model: DistributedDataParallel, config: "DDPXConfig") -> None:
    """Register the configured hook (a name: ``check_options`` refused the rest) through the one route
    that builds hooks, ``DDPXConfig.register_hook``, and hand ``model`` to the fault tolerance, which makes
    the hook follow the membership (both strategies)."""
    config.register_hook(model, follow_default_group=True)  # each generation's group, not the first's
    fault.attach(model, comm_hook=config.comm_hook, synchronized=fault.generation.number == 1)


def membership_record(fault: FaultTolerance) -> dict[str, Any]:
    """What a checkpoint of a fault-tolerant run records under ``CHECKPOINT_KEY`` (both strategies): the
    generation and world size that saved it, and the hook's shared state (PowerSGD's, DiLoCo's; per-rank
    error feedback starts from zero on resume)."""
    return {
        "generation": fault.generation.number,
        "world_size": fault.world_size,
        "hook": fault.hook_state_dict(),
    }


def check_trainer(trainer: Any, backend: str) -> None:
    """Refuse the Trainer settings fault tolerance cannot follow, before the first step."""
    check_backend(backend)
    if not trainer.lightning_module.automatic_optimization:
        raise ValueError(
            "DDPXStrategy: fault_tolerance supports automatic optimisation only: with manual optimisation the "
            "strategy cannot tell where a step begins and ends."
        )


class FaultTolerantTrainerRun(TrainerRun):
    """The Trainer strategy's run with ``fault_tolerance`` (see the module's docstring). Outside a training
    process (the launching process, after ``fit``) it has not joined a run (``fault`` is ``None``), and the
    seams that need a membership behave as the plain run's."""

    def __init__(self, options: FaultToleranceOptions) -> None:
        self.options = options
        self.fault: Optional[FaultTolerance] = None  # in a training process, once it joined the run
        self.trainer: Any = None
        self._training = _FollowedSamplers()  # the training loaders' DistributedSamplers
        self._validation = _FollowedSamplers()  # the validation loaders'
        self._boundary_epoch: Optional[int] = None  # the epoch whose start the members last passed
        self._restored = False  # a newcomer's checkpoint was handed to its fit
        self._logged: dict[str, float] = {}
        self._step_begun = False  # an optimizer step's first batch began, its optimizer step has not run
        self._healed = 0  # newcomers healed so far, as this process counted them
        self._state_check_due = False  # a heal happened: compare the whole state after the next step
        self.metrics = MetricSyncGuard(self.between_steps)  # torchmetrics' own syncs, at set-up

    # ------------------------------------------------------------------------------------- processes
    def cluster_environment(self, given: Optional["ClusterEnvironment"]) -> "ClusterEnvironment":
        return fault_tolerant_environment(given)

    def launcher(self, strategy: TrainerStrategyView, start_method: str, backend: Callable[[], str]) -> Any:
        """The fault-tolerant launcher: it supervises one machine's processes and replaces lost ones."""
        refuse_several_machines(strategy.num_nodes)
        environment = strategy.cluster_environment
        assert isinstance(environment, FaultTolerantEnvironment)
        environment.num_processes = strategy.num_processes
        return FaultTolerantLauncher(
            strategy.num_processes, self.options, check=lambda trainer: check_trainer(trainer, backend())
        )

    def distributed_sampler_kwargs(self, strategy: TrainerStrategyView, default: Default) -> dict[str, Any]:
        """The membership's world size and rank (a world of one in the launching process after fit), not
        the devices': a loader built after a change is sharded by the members."""
        return {"num_replicas": strategy.world_size, "rank": strategy.global_rank}

    def setup_distributed(
        self, strategy: TrainerStrategyView, default: Default, backend: Callable[[], str]
    ) -> None:
        """A training process joins the run (its group is the membership's); the launching process, after
        fit, is a world of one."""
        if not in_training_process():
            strategy.set_world_ranks()
            return
        launcher = strategy.launcher
        assert isinstance(launcher, FaultTolerantLauncher)
        check_trainer(launcher.trainer, backend())
        self.join(launcher.trainer, strategy.cluster_environment)
        strategy.set_world_ranks()

    def set_world_ranks(self, strategy: TrainerStrategyView, default: Default) -> None:
        follow_rank(strategy.global_rank)  # the membership's rank (the environment's)

    # ------------------------------------------------------------------------------------- the module
    def init_sync(self) -> Optional[bool]:
        """A newcomer is healed at its first boundary, not by a broadcast at the wrap."""
        return None if self.fault is None else self.fault.generation.number == 1

    def register_hook(self, model: DistributedDataParallel, config: "DDPXConfig") -> tuple[Any, bool]:
        """The hook follows the membership: the fault tolerance builds it (by name: ``check_options``
        refused the rest) and keeps its shared state in the membership record of each checkpoint."""
        fault = self.fault
        if fault is None:
            return super().register_hook(model, config)
        attach_hook(fault, model, config)
        return fault.comm_hook_state, False

    def after_setup(self, module: Any) -> None:
        if module is not None:
            self.metrics.guard(module)  # a loss in a metric's sync: its own value

    def process_dataloader(self, dataloader: Any, stage: Optional[RunningStage], training: Default) -> Any:
        """Loaders sharded by the membership, resharded with it (no lockstep wrapper: every member runs the
        same number of batches, checked at each epoch's start)."""
        if stage == RunningStage.TRAINING:
            self.watch_samplers(dataloader)
        elif stage in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING):
            self.watch_validation_samplers(dataloader)
        return dataloader

    def validation_step(self, wrapped: Default, own: Default) -> Any:
        """The LightningModule's own step: the wrapper's forward would synchronise buffers, a collective
        outside the training steps the members agree on."""
        return own()

    # ------------------------------------------------------------------------------------------ join
    def join(self, trainer: Any, environment: Any) -> FaultTolerance:
        """Join the run (a training process): wait to be admitted, build the first group, take the
        newcomer's checkpoint if this is one, and pin the loggers' versions to the run's."""
        self.trainer = trainer
        fault = self.fault = join_following_ranks(self.options, environment)
        fault.healer.use_state(self._dump, self._load)
        fault.protocol.receive_state()
        self._pin_logger_versions(fault)
        return fault

    def _pin_logger_versions(self, fault: FaultTolerance) -> None:
        """Every process logs into the first rank 0's logger versions: after it is lost, the new rank 0
        appends to the same directory instead of starting another."""
        contain_logger_failures(self.trainer)
        loggers = lightning_compat.versioned_loggers(self.trainer)
        if not loggers:
            return
        store = fault.store
        if fault.generation.number == 1 and fault.rank == 0:
            store.compare_set(_LOGGER_VERSIONS_KEY, "", json.dumps([logger.version for logger in loggers]))
        store.wait([_LOGGER_VERSIONS_KEY])
        continue_loggers(self.trainer, json.loads(store.get(_LOGGER_VERSIONS_KEY)))

    # ------------------------------------------------------------------------------------------ heal
    def _dump(self) -> dict[str, Any]:
        checkpoint = lightning_compat.dump_checkpoint(self.trainer)
        checkpoint[CHECKPOINT_KEY] = self.membership_record()
        checkpoint[_HANDED_ON_KEY] = self._handed_on()
        return checkpoint

    def _load(self, checkpoint: dict[str, Any]) -> None:
        """A newcomer's fit restores this as from ``ckpt_path``. Sent again when a member was lost while the
        newcomer was healed: the members have not stepped since, and the replica check proves it."""
        if not self._restored:
            handed_on = checkpoint.pop(_HANDED_ON_KEY, {})
            for callback in self.trainer.checkpoint_callbacks:
                if callback.state_key in handed_on:
                    lightning_compat.restore_model_checkpoint_progress(
                        callback, handed_on[callback.state_key]
                    )
            lightning_compat.restore_on_fit(self.trainer, checkpoint)
            self._restored = True

    def _handed_on(self) -> dict[str, Any]:
        """What a newcomer must take beyond what a checkpoint holds: each ModelCheckpoint's own progress
        (when it last saved). A resumed run starts every rank alike without it; a newcomer without it
        would save, a collective, at a step where the members do not."""
        return {
            callback.state_key: lightning_compat.model_checkpoint_progress(callback)
            for callback in self.trainer.checkpoint_callbacks
        }

    def membership_record(self) -> dict[str, Any]:
        assert self.fault is not None
        return membership_record(self.fault)

    def resume(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint loaded with ``ckpt_path``: its hook state, once the hook exists."""
        if self.fault is not None:
            self.fault.load_hook_state_dict((checkpoint.get(CHECKPOINT_KEY) or {}).get("hook"))

    # ---------------------------------------------------------------------------------- the epochs
    def watch_samplers(self, dataloader: Any) -> None:
        """Follow the training loader's ``DistributedSampler``: its ``set_epoch`` is each epoch's boundary."""
        self._training.follow(dataloader, self.epoch_boundary)

    def epoch_boundary(self) -> None:
        """Once per training epoch, before its first batch, on every member: admit waiting replacements, then
        reshard the samplers if the membership changed."""
        fault, trainer = self.fault, self.trainer
        if fault is None or trainer is None or self._boundary_epoch == trainer.current_epoch:
            return
        self._boundary_epoch = trainer.current_epoch
        fault.protocol.boundary(admit=True)
        if fault.stats.newcomers_healed != self._healed:
            self._healed = fault.stats.newcomers_healed
            self._state_check_due = True
        self._reshard(fault)
        self._check_equal_batches()
        self.log_membership(force=True)

    def _check_equal_batches(self) -> None:
        """Every member must run as many training batches this epoch as the others: the steps are agreed
        one by one, so a member with a batch more would start a step (its gradients' all-reduce) that the
        others never join, and its collective would meet theirs of the epoch's end. Compared once per epoch
        (an all-gather of one number); refused on every member alike, naming each rank's count. A loader
        without a length is not checked."""
        batches = self.trainer.fit_loop.max_batches
        if not isinstance(batches, int):
            return
        # the strategy's all_gather: after a loss it gives this process's own count alone (not refused)
        counts = [int(c) for c in self.trainer.strategy.all_gather(torch.tensor([batches])).reshape(-1)]
        if len(set(counts)) > 1:
            by_rank = dict(enumerate(counts))
            raise ValueError(
                f"DDPXStrategy: fault_tolerance needs every rank to get the same number of training batches per "
                f"epoch; epoch {self.trainer.current_epoch} gives ranks {by_rank} batches. Let Lightning add "
                "its DistributedSampler (use_distributed_sampler=True, the default), which the fault "
                "tolerance reshards when the membership changes, or make your sampler give every rank as many."
            )

    def _reshard(self, fault: FaultTolerance) -> None:
        """The training samplers over the members present, and the epoch's batch count (and the batch at
        which a fractional ``val_check_interval`` validates) recomputed from them, as Lightning computes
        both when it builds the loader."""
        if not self._training.reshard(fault.world_size, fault.rank):
            return
        combined = lightning_compat.train_combined_loader(self.trainer)
        if combined is not None and self._training.samplers:
            limits = [
                lightning_compat.parse_num_batches(len(loader), self.trainer.limit_train_batches)
                for loader in combined.flattened
            ]
            combined.limits = limits
            lightning_compat.set_training_batches(
                self.trainer, lightning_compat.combined_length(combined, limits)
            )

    def watch_validation_samplers(self, dataloader: Any) -> None:
        """Follow a validation loader's ``DistributedSampler``: the validation loop sets its epoch at each
        validation's start, where it is resharded over the members present (and the loop's batch count with
        it), so that every validation covers its data once over them."""
        self._validation.follow(dataloader, self._reshard_validation)

    def _reshard_validation(self) -> None:
        fault, trainer = self.fault, self.trainer
        if fault is None or trainer is None:
            return
        if not self._validation.reshard(fault.world_size, fault.rank):
            return
        loaders = lightning_compat.validation_loaders(trainer)
        if loaders:
            counts = [
                lightning_compat.parse_num_batches(len(loader), trainer.limit_val_batches, validation=True)
                for loader in loaders
            ]
            lightning_compat.set_validation_batches(trainer, counts)

    # ----------------------------------------------------------------------------------- the steps
    def on_train_batch_start(self, batch_idx: int) -> None:
        if batch_idx == 0:
            self.epoch_boundary()  # once per epoch: here if no DistributedSampler's set_epoch came first
        self.begin_batch()

    def begin_batch(self) -> None:
        """At each training batch's start (after the epoch's boundary). The first batch of an optimizer step
        (every batch; with ``accumulate_grad_batches=k`` the first of k) applies a membership change decided
        since the last step, so that every micro-batch of the step runs in the new group."""
        if self.fault is None or self._step_begun:
            return
        self._step_begun = True
        self.fault.protocol.prepare_step()

    def accumulating_step(self, run: Callable[[], Any], device: torch.device) -> Any:
        """A micro-batch's ``training_step`` that accumulates locally (gradient accumulation): between steps
        for the fault tolerance. When a collective in it fails on any member (a buffer broadcast, a synced
        log), every member regroups and skips this micro-batch alike (it is not run twice): it returns a
        zero loss that reaches no parameter (Lightning refuses a ``None`` in distributed training), and the
        step's other micro-batches synchronise in the new group."""
        if self.fault is None:
            return run()

        def skipped() -> torch.Tensor:
            return torch.zeros((), device=device, requires_grad=True)

        return self.fault.outside_step(run, skipped, retry=False)

    def optimizer_step(
        self,
        step: Callable[[Callable[[], Any]], Any],
        closure: Callable[[], Any],
        batch_idx: int,
        model: Optional[DistributedDataParallel],
        optimizers: Sequence[Any],
    ) -> Any:
        """Run the closure inside a fault-tolerant step; ``step(closure)`` (the optimizer's) only if every
        member's collectives succeeded. Then a hook that averages parameters (DiLoCo's outer step,
        post-local SGD's average) averages when due, voted on and retried over the survivors; replacements
        still wait for the next epoch's start."""
        if self.fault is None:
            return super().optimizer_step(step, closure, batch_idx, model, optimizers)
        self._step_begun = False
        with self.fault.step(admit=False) as outcome:
            loss = closure()
        if not outcome.committed:
            return self._discarded(closure, batch_idx, outcome.error or "a member was lost")
        result = step(lambda: loss)
        if self.fault.model is not None and self.fault.model.parameter_averaging is not None:
            optimizers = [lightning_compat.unwrapped_optimizer(o) for o in optimizers]
            self.fault.average_after_step(optimizers, admit=False)
        if self._state_check_due:
            self._state_check_due = False
            self._verify_whole_state()
        self.log_membership(force=False)
        return result

    def _discarded(self, closure: Callable[[], Any], batch_idx: int, why: str) -> None:
        lightning_compat.discard_closure_result(closure)
        log.warning(
            "lightning_ddpx fault tolerance: the update of epoch %d, batch %d (global step %d) was "
            "discarded on every member (%s); that batch's share of the data is skipped.",
            self.trainer.current_epoch,
            batch_idx,
            self.trainer.global_step,
            why,
        )
        self.log_membership(force=True)

    def _verify_whole_state(self) -> None:
        """After the first step that a healed newcomer trained: every member's whole training state -- what
        a checkpoint holds: parameters, optimizers and their hyper-parameters, schedulers, loops, each
        callback (:mod:`~lightning_ddpx.lightning.fault_tolerance.state`) -- the same, or a named error on
        every member. The replica check at the heal covers parameters and buffers only; a scheduler or a
        callback restored differently would split the members' later updates silently."""
        assert self.fault is not None
        module = self.trainer.lightning_module
        digests = state_digests(
            lightning_compat.dump_checkpoint(self.trainer), (name for name, _ in module.named_parameters())
        )
        digests["handed on"] = digest(self._handed_on())
        if self.fault.model is not None and self.fault.model.parameter_averaging is not None:
            # DiLoCo, post-local SGD: each replica trains on its own between averages
            digests.pop("parameters"), digests.pop("optimizer state")
        gathered = self.between_steps(lambda: _gather_objects(digests), lambda: None)
        if gathered is None:
            return
        differing = {
            name: [found.get(name) for found in gathered]
            for name in digests
            if len({found.get(name) for found in gathered}) > 1
        }
        if differing:
            pieces = "; ".join(f"{name}: digests by rank {by_rank}" for name, by_rank in differing.items())
            raise FaultToleranceError(
                f"lightning_ddpx fault tolerance: after newcomers were healed, the members' training state "
                f"differs ({pieces}); a piece of state was not handed on or restored alike. Please report it "
                "with the callbacks and schedulers this run uses."
            )
        self.fault.stats.events.append("whole training state verified equal on every member after a heal")

    def log_membership(self, force: bool) -> None:
        """The membership figures (``fault_tolerance/world_size``, ``failures``, ``last_recovery_s``, ...) to
        the Trainer's loggers when they changed, and every ``log_every_n_steps``."""
        fault, trainer = self.fault, self.trainer
        if fault is None or trainer is None or not trainer.loggers:
            return
        metrics = fault.stats.metrics()
        due = trainer.global_step % max(trainer.log_every_n_steps, 1) == 0
        if not (force or due or metrics != self._logged):
            return
        self._logged = metrics
        for logger in trainer.loggers:  # rank-zero-only: the current rank 0 writes
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------------------ between steps
    def between_steps(self, run: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
        """A collective of Lightning's between steps (see the module's docstring): voted on, and run again
        over the members present when it failed on any; ``fallback()`` outside a training process."""
        if self.fault is None or not dist.is_initialized():
            return fallback()
        return self.fault.outside_step(run, fallback)

    def verification(self, verify: Callable[[], None]) -> None:
        self.between_steps(verify, lambda: None)

    def barrier(self, default: Default) -> None:
        """Nothing: a barrier cannot tell a slow member from a lost one, and the members meet at every step
        anyway."""

    # ------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, checkpoint: dict[str, Any], add_state: Callable[[], None], write: Default
    ) -> None:
        """The hook's shared state goes in the membership record (no per-rank state is added); the write is
        voted on: if rank 0 is lost before or while writing, the new rank 0 writes it, so that the file
        exists wherever ModelCheckpoint records it (outside a training process: written as usual)."""
        if self.fault is not None:
            checkpoint[CHECKPOINT_KEY] = self.membership_record()
        self.between_steps(write, write)

    def remove_checkpoint(self, remove: Default) -> None:
        """Voted on as a save is: a file ModelCheckpoint drops from its top-k is removed by whichever
        process is rank 0 once every member agreed, not left behind by a lost one."""
        self.between_steps(remove, remove)

    def load_checkpoint(self, checkpoint: dict[str, Any], take_state: Callable[[], None]) -> None:
        """The hook's shared state is the membership record's (see :meth:`resume`)."""
        self.resume(checkpoint)

    def agree(self, decision: bool) -> bool:
        """A boolean decision between steps, one on every member even if its collective failed on some
        (:meth:`~lightning_ddpx.fault.steps.StepProtocol.agree`); as given outside a training process."""
        if self.fault is None:
            return decision
        return self.fault.protocol.agree(decision)

    def close(self) -> None:
        self.metrics.release()
        if self.fault is not None:
            self.fault.close()


class FaultTolerantFabricRun(FabricRun):
    """The Fabric strategy's run with ``fault_tolerance``: ``fabric.launch()`` joins the run, and the loop
    steps through ``fabric.strategy.fault_manager`` (docs/fault-tolerance.md). Before it joined (the
    launching process) the seams that need a membership behave as the plain run's."""

    def __init__(self, options: FaultToleranceOptions) -> None:
        self.options = options
        self._fault: Optional[FaultTolerance] = None
        self._metrics = MetricSyncGuard(self._sync_between_steps)  # torchmetrics' own syncs, at set-up

    @property
    def fault(self) -> Optional[FaultTolerance]:
        return self._fault

    def cluster_environment(self, given: Optional["ClusterEnvironment"]) -> "ClusterEnvironment":
        return fault_tolerant_environment(given)

    def launcher(self, strategy: StrategyView, start_method: str) -> Any:
        refuse_several_machines(strategy.num_nodes)
        environment = strategy.cluster_environment
        assert isinstance(environment, FaultTolerantEnvironment)
        environment.num_processes = strategy.num_processes
        return FabricFaultTolerantLauncher(strategy.num_processes, self.options)

    def distributed_sampler_kwargs(self, strategy: StrategyView, default: Default) -> dict[str, Any]:
        """The membership's world size and rank, not the devices'."""
        return {"num_replicas": strategy.world_size, "rank": strategy.global_rank}

    def setup_distributed(self, strategy: StrategyView, default: Default, backend: Callable[[], str]) -> None:
        """Join the run (its group is the membership's); ranks follow it."""
        check_backend(backend())
        self._fault = join_following_ranks(self.options, strategy.cluster_environment)

    def wrap(
        self, module: nn.Module, config: "DDPXConfig", device_ids: Optional[list[int]]
    ) -> DistributedDataParallel:
        """Healed at the first step (a newcomer) or already equal (the first generation): no broadcast at
        the wrap; the hook follows the membership."""
        fault = self._fault
        if fault is None:
            return super().wrap(module, config, device_ids)
        wrapped = config.wrap(module, device_ids=device_ids, init_sync=fault.generation.number == 1)
        attach_hook(fault, wrapped, config)
        self._metrics.guard(module)  # a loss during a metric's sync: its own value
        return wrapped

    def track_optimizer(self, optimizer: Any) -> None:
        if self._fault is not None:
            self._fault.track(optimizer)  # a newcomer receives its state with the model's

    def process_dataloader(self, dataloader: Any, lockstep: Default) -> Any:
        return dataloader  # the loop keys its data on the fault tolerance's step, rank and world size

    def average_after_step(self, module: DistributedDataParallel, optimizers: Sequence[Any]) -> None:
        """Snapshotted, voted on, retried over the survivors."""
        if self._fault is None:
            return super().average_after_step(module, optimizers)
        self._fault.average_after_step(list(optimizers))

    def verification(self, verify: Callable[[], None]) -> None:
        self.between_steps(verify, None)

    def barrier(self, default: Default) -> None:
        """Nothing: a barrier cannot tell a slow member from a lost one."""

    def between_steps(self, run: Default, own: Any) -> Any:
        """A collective that fails between steps gives this process's own value (``own``) and the
        membership changes at the next step; inside a step a failure is the step's."""
        return self._sync_between_steps(run, lambda: own)

    def _sync_between_steps(self, run: Default, fallback: Default) -> Any:
        if self._fault is None:
            return run()
        return self._fault.outside_step(run, fallback)

    def state_to_save(self, state: dict[str, Any], with_ours: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The membership record (with the hook's shared state) instead of per-rank entries; the
        membership's rank 0 writes."""
        if self._fault is None:
            return super().state_to_save(state, with_ours)
        return {**state, CHECKPOINT_KEY: membership_record(self._fault)}

    def load_checkpoint(self, remainder: dict[str, Any], restore_ours: Callable[[], None]) -> None:
        """PowerSGD's or DiLoCo's shared state, from the membership record, once the hook exists."""
        if self._fault is None:
            return super().load_checkpoint(remainder, restore_ours)
        entry = remainder.pop(CHECKPOINT_KEY, None) or {}
        self._fault.load_hook_state_dict(entry.get("hook"))

    def close(self) -> None:
        self._metrics.release()
        if self._fault is not None:
            self._fault.close()


def join_following_ranks(options: FaultToleranceOptions, environment: Any) -> FaultTolerance:
    """Join the run (both strategies): wait to be admitted and build the first group; from then on the
    strategy's environment and Lightning's ``rank_zero_only`` follow the membership's rank of this process."""
    assert isinstance(environment, FaultTolerantEnvironment)
    fault = environment.fault = join_run(options)
    fault.generation_listeners.append(lambda generation: follow_rank(generation.rank_of(fault.uid)))
    follow_rank(fault.rank)
    return fault


def follow_rank(rank: int) -> None:
    """Lightning's ``rank_zero_only`` (its loggers', progress bar's and warnings' gate) at ``rank``: the
    membership's rank of this process, which changes when the membership does."""
    rank_zero_only.rank = fabric_rank_zero_only.rank = rank


def _gather_objects(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class _FollowedSamplers:
    """The distributed samplers of one kind of loader (training, validation), each wrapped so that the
    loop setting its epoch -- where the loop starts an epoch or a validation -- first calls a hook, and
    sharded over the members present when asked."""

    def __init__(self) -> None:
        self.samplers: list[DistributedSampler] = []
        self._sharded_for: Optional[tuple[int, int]] = None  # (world size, rank) they are sharded for

    def follow(self, dataloader: Any, before_set_epoch: Callable[[], None]) -> None:
        """Each sampler of ``dataloader`` not followed yet calls ``before_set_epoch()`` before its epoch is
        set. A loader built now is sharded by the current membership: the next :meth:`reshard` checks."""
        for sampler in _distributed_samplers(dataloader):
            if any(sampler is seen for seen in self.samplers):
                continue
            self.samplers.append(sampler)
            set_epoch = sampler.set_epoch

            def set_epoch_after(epoch: int, _set_epoch: Callable[[int], None] = set_epoch) -> None:
                before_set_epoch()
                _set_epoch(epoch)

            sampler.set_epoch = set_epoch_after  # type: ignore[method-assign]
        self._sharded_for = None

    def reshard(self, world_size: int, rank: int) -> bool:
        """Shard every sampler as if built for ``world_size`` and ``rank``, unless it already is; returns
        whether anything changed (the loop's batch counts then follow)."""
        if (world_size, rank) == self._sharded_for:
            return False
        self._sharded_for = (world_size, rank)
        for sampler in self.samplers:
            _shard(sampler, world_size, rank)
        return True


def _distributed_samplers(dataloader: Any) -> list[DistributedSampler]:
    loaders = getattr(dataloader, "flattened", None) or [dataloader]
    found = []
    for loader in loaders:
        for candidate in (
            getattr(loader, "sampler", None),
            getattr(getattr(loader, "batch_sampler", None), "sampler", None),
        ):
            if isinstance(candidate, DistributedSampler):
                found.append(candidate)
    return found


def _shard(sampler: DistributedSampler, num_replicas: int, rank: int) -> None:
    """``sampler`` as if built for ``num_replicas`` and ``rank`` (DistributedSampler's own arithmetic)."""
    size = len(sampler.dataset)  # type: ignore[arg-type]
    sampler.num_replicas, sampler.rank = num_replicas, rank
    if sampler.drop_last and size % num_replicas:
        sampler.num_samples = math.ceil((size - num_replicas) / num_replicas)
    else:
        sampler.num_samples = math.ceil(size / num_replicas)
    sampler.total_size = sampler.num_samples * num_replicas
