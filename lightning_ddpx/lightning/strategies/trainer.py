"""``DDPXStrategy``: Lightning's DDP strategy running on lightning_ddpx's module and communication hooks.

Switching is one line, ``Trainer(strategy="ddpx")`` instead of ``"ddp"``. Launching, rendezvous, samplers
and cluster environments stay Lightning's (we subclass ``DDPStrategy`` for them). What changes:

- the LightningModule is wrapped in :class:`lightning_ddpx.DistributedDataParallel`, never torch's; every
  place where Lightning's ``DDPStrategy`` assumes torch's class (reducer internals in ``pre_backward`` /
  ``post_backward``, ``teardown``, ``on_exception``, the forward redirection) is overridden here;
- the communication hook is chosen by name (``comm_hook="powersgd"``) or passed as a callable, and is
  applied on every device (Lightning registers hooks on CUDA only and ignores them on CPU);
- the hook's state (PowerSGD error feedback of every rank, shared warm-start memory, iteration) goes into
  the checkpoint Lightning writes and is restored on resume (see :mod:`lightning_ddpx.lightning.checkpoints.checkpoint_state`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddpx.engine.agreement.consistency import broadcast_from_rank0
from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.engine.optim.parameter_averaging import ParameterAveraging
from lightning_ddpx.lightning import _compat as lightning_compat
from lightning_ddpx.lightning._compat import PATH
from lightning_ddpx.lightning.checkpoints import checkpoint_state, local_replicas
from lightning_ddpx.lightning.checkpoints.checkpoint_io import AtomicCheckpointIO
from lightning_ddpx.lightning.fault_tolerance.runs import FaultTolerantTrainerRun
from lightning_ddpx.lightning.features import diloco_setup, optimizer_overlap_setup, post_local_sgd_setup
from lightning_ddpx.lightning.features.compile import apply_lightning_compile
from lightning_ddpx.lightning.features.replica_verification import ReplicaVerifier
from lightning_ddpx.lightning.features.uneven import StepQueue
from lightning_ddpx.lightning.processes.process_exit import destroy_process_group_at_exit
from lightning_ddpx.lightning.processes.restart_rendezvous import create_default_group
from lightning_ddpx.lightning.runs.trainer_run import TrainerRun
from lightning_ddpx.lightning.settings.config import (
    TRAINER_STRATEGY_NAMES,
    DDPXConfig,
    DDPXConfigAttributes,
    register_strategy_names,
)
from lightning_ddpx.lightning.settings.ddp_kwargs import build_ddpx_config, torch_ddp_kwargs
from lightning_ddpx.lightning.settings.options import takes_ddpx_options

__all__ = ["UNUSED_PARAMETERS_HINT", "DDPXStrategy"]

log = logging.getLogger(__name__)

# Lightning's sentence for a parameter without gradient (its DDPStrategy.on_exception), in our names.
UNUSED_PARAMETERS_HINT = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. If this is intentional, you must enable the detection of unused parameters in DDP, either "
    "by setting the string value `strategy='ddpx_find_unused_parameters_true'` or by setting the flag in the "
    "strategy with `strategy=DDPXStrategy(find_unused_parameters=True)`."
)
_UNUSED_PARAMETERS = "received no gradient"  # in the engine's error for a parameter without gradient


@takes_ddpx_options("Trainer")
class DDPXStrategy(DDPXConfigAttributes, DDPStrategy):
    """Multi-process data parallelism with lightning_ddpx's gradient reducer and communication hooks.

    Takes every argument of Lightning's ``DDPStrategy`` (``ddp_comm_hook``, ``ddp_comm_state`` and
    ``ddp_comm_wrapper`` are other spellings of ``comm_hook``, ``comm_state`` and ``comm_wrapper``) and every
    torch DDP keyword argument Lightning passes through: honoured with torch's meaning, or refused with an
    error saying what to do instead (table in docs/strategy.md; :mod:`lightning_ddpx.lightning.settings.ddp_kwargs`). Plus
    the options below, declared once for both strategies (:mod:`lightning_ddpx.lightning.settings.options`), keyword-only.

    The options are read back as attributes (``strategy.comm_hook``, ``strategy.powersgd``, ...) from
    ``strategy.ddpx_config``, the :class:`~lightning_ddpx.lightning.settings.config.DDPXConfig` shared with the Fabric strategy
    (:mod:`lightning_ddpx.lightning.strategies.fabric`).

    Example::

        >>> import lightning as L
        >>> from lightning_ddpx import DDPXStrategy
        >>> strategy = DDPXStrategy(comm_hook="powersgd", powersgd={"matrix_approximation_rank": 2})
        >>> strategy.powersgd.matrix_approximation_rank
        2
        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP
        >>> trainer.fit(lightning_module)  # doctest: +SKIP
        >>> # or by name (registered when lightning_ddpx is imported): "ddpx", "ddpx_powersgd", ...
        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddpx")  # doctest: +SKIP
    """

    strategy_name = "ddpx"

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,  # ours (the signature lists them: takes_ddpx_options) and torch DDP's, checked by name
    ) -> None:
        # Validate everything before Lightning sees the strategy: a typo fails at once, not after launch.
        self.ddpx_config = build_ddpx_config(type(self).__name__, "Trainer", kwargs)
        # how the processes run, chosen once: plain, or fault tolerant (lightning/runs/trainer_run.py)
        self._run = _choose_run(self.ddpx_config)
        cluster_environment = self._run.cluster_environment(cluster_environment)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._ddp_kwargs = torch_ddp_kwargs(kwargs)  # Lightning's attribute: torch DDP's arguments, as given
        # Lightning's redirection toggles torch-DDP attributes in manual optimisation; ours needs none of it
        # (see training_step/pre_backward), so use the plain one.
        self._forward_redirection = lightning_compat.ForwardRedirection()
        self._hook_state: Any = None  # the state registered with the module (built or given)
        self._hook_registered = False  # a module was set up with the hook: there is state worth saving
        self._final_bucket_layout: Optional[dict[str, Any]] = None  # the last module's, kept at teardown
        # (entry,) once load_checkpoint ran -- entry is None for a checkpoint without hook state -- until the
        # hook exists; None when no checkpoint was loaded since the last setup. A tuple, not a sentinel
        # object, so the strategy survives pickling (ddpx_spawn).
        self._pending_hook_entry: tuple[Any] | None = None
        self._sync_blocked = 0  # depth of block_backward_sync(); read by manual optimisation
        # the module's parameter averaging (post-local SGD, DiLoCo), run after each optimizer_step; kept after
        # teardown for a checkpoint saved then
        self._averaging: Optional[ParameterAveraging] = None
        self._pending_replica: Optional[dict[str, Any]] = None  # this rank's weights from a checkpoint
        self._uneven_steps = StepQueue()  # what the ranks agreed for each fetched training batch
        self._replicas = ReplicaVerifier(self.ddpx_config.verify_replicas_every_n_steps)

    # ------------------------------------------------------------------------------------ description
    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's default, made atomic: :class:`~lightning_ddpx.lightning.checkpoints.checkpoint_io.AtomicCheckpointIO`
        unless a CheckpointIO was given (argument or ``Trainer(plugins=...)``); a wrapping plugin such as
        ``AsyncCheckpointIO`` without an inner IO gets the atomic one inside."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, lightning_compat.WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()  # fills only an empty inner slot
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    @property
    def comm_hook_state(self) -> Any:
        """The registered hook's state (e.g. the ``PowerSGDState``), once ``setup`` has built it."""
        return self._hook_state

    # ------------------------------------------------------------------------------------------ setup
    @override
    def _configure_launcher(self) -> None:
        launcher = self._run.launcher(self, self._start_method, self._get_process_group_backend)
        if launcher is None:
            return super()._configure_launcher()
        self._launcher = launcher

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # creates the process group
        destroy_process_group_at_exit()  # so the process exits with its status, never SIGABRT

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With fault_tolerance, the membership's world size and rank (a world of one in the launching
        process after fit), not the devices': a loader built after a change is sharded by the members."""
        return self._run.distributed_sampler_kwargs(
            self, lambda: super(DDPXStrategy, self).distributed_sampler_kwargs
        )

    @override
    def setup_distributed(self) -> None:
        """With fault_tolerance, a training process joins the run (its group is the membership's); the
        launching process, after fit, is a world of one."""
        self._run.setup_distributed(self, self._create_default_group, self._get_process_group_backend)

    def _create_default_group(self) -> None:
        self.set_world_ranks()
        # torchrun shares its store across restarts: this round's keys only (lightning.restart_rendezvous)
        create_default_group(
            self.cluster_environment, self._get_process_group_backend(), self._timeout, self.root_device
        )
        super().setup_distributed()  # Lightning's creation, when that created none

    @override
    def set_world_ranks(self) -> None:
        self._run.set_world_ranks(self, lambda: super(DDPXStrategy, self).set_world_ranks())

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        layer_sync = lightning_compat.layer_sync(self)
        if fitting and layer_sync:
            self.model = layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.configure_ddp()
            self.setup_optimizers(trainer)  # after wrapping: the module is on its device
            if self.overlap_optimizer:
                assert isinstance(self.model, DistributedDataParallel)
                optimizer_overlap_setup.attach_trainer_optimizer(
                    self.model, trainer, self.optimizers, self.precision_plugin
                )
        elif dist.is_initialized():
            # Evaluation needs no gradient reducer, but every rank must hold rank 0's weights, as in training.
            module = self.model
            with waiting_for(f"rank 0's weights before {trainer.state.fn.value}", dist.group.WORLD):
                broadcast_from_rank0(
                    [p.detach() for p in module.parameters()] + list(module.buffers()), dist.group.WORLD
                )
        self._pending_hook_entry = None  # a checkpoint loaded for evaluation must not leak into a later fit
        self._pending_replica = None
        self.setup_precision_plugin()
        if fitting:
            lightning_compat.optimizers_to_device(self.optimizers, self.root_device)
            self._enable_model_averaging()
            self._run.after_setup(self.lightning_module)

    @override
    def _enable_model_averaging(self) -> None:
        """Average after each optimizer step when the hook brings parameter averaging: post-local SGD (as
        Lightning's DDPStrategy), DiLoCo."""
        model = self.model
        self._averaging = model.parameter_averaging if isinstance(model, DistributedDataParallel) else None
        if self._averaging is not None:
            log.debug(f"{type(self).__name__}: {self._averaging.name} with {self._averaging!r}")
            post_local_sgd_setup.check_optimizers(self.optimizers)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Step, then (post-local SGD) average the model's optimized parameters when due.

        With ``overlap_optimizer`` the closure's backward steps the optimizer: run only the closure."""
        trainer = (
            lightning_compat.trainer_of(self.lightning_module) if self.lightning_module is not None else None
        )
        output = self._run.optimizer_step(
            lambda done: self._step_optimizer(optimizer, done, model, **kwargs),
            closure,
            trainer.fit_loop.epoch_loop.batch_idx if trainer is not None else -1,
            self.model if isinstance(self.model, DistributedDataParallel) else None,
            self.optimizers,
        )
        if self._averaging is not None and self.comm_stats_every_n_steps and trainer is not None:
            diloco_setup.log_outer_syncs(self._hook_state, trainer)  # DiLoCo: bytes of each outer sync
        self._replicas.after_optimizer_step(self._our_model(), around=self._run.verification)
        return output

    def _step_optimizer(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, torch.nn.Module]],
        **kwargs: Any,
    ) -> Any:
        if self.overlap_optimizer:
            return optimizer_overlap_setup.step_with_closure(
                self.precision_plugin,
                self.model,
                model or self.lightning_module,
                optimizer,
                closure,
                **kwargs,
            )
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _our_model(self) -> list[DistributedDataParallel]:
        return [self.model] if isinstance(self.model, DistributedDataParallel) else []

    @override
    def configure_ddp(self) -> None:
        log.debug(
            f"{type(self).__name__}: wrapping the LightningModule in lightning_ddpx.DistributedDataParallel"
        )
        assert isinstance(self.model, LightningModule)
        self.model = self._setup_model(self.model)
        self._register_ddp_hooks()
        self._restore_hook_state()
        self._restore_local_replica()  # after the wrap, which broadcasts rank 0's weights
        apply_lightning_compile(self.model)  # torch.compile(module): split at bucket boundaries

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        return self.ddpx_config.wrap(
            model, device_ids=self.determine_ddp_device_ids(), init_sync=self._run.init_sync()
        )

    @override
    def _register_ddp_hooks(self) -> None:
        """Build and register the communication hook, on every device type (CPU included)."""
        assert isinstance(self.model, DistributedDataParallel)
        log.debug(f"{type(self).__name__}: registering comm hook {self.hook_name}")
        self._hook_state, self._hook_registered = self._run.register_hook(self.model, self.ddpx_config)

    # ---------------------------------------------------------------------------------- uneven inputs
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders are iterated in lockstep across ranks (``uneven_inputs``); others untouched."""
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        trainer = lightning_compat.trainer_of(module) if module is not None else None
        if trainer is None:
            return dataloader
        return self._run.process_dataloader(
            dataloader,
            trainer.state.stage,
            lambda: self.ddpx_config.wrap_training_loader(
                dataloader, dist.group.WORLD, self.root_device, self._uneven_steps, for_fabric=False
            ),
        )

    @property
    def replaying(self) -> bool:
        """Whether this rank's current training batch is a replay (its own batches ran out, others' not):
        its backward counts zero. Callbacks that count samples or update metrics may skip such steps."""
        return self._uneven_steps.replaying

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._run.on_train_batch_start(batch_idx)
        info = self._uneven_steps.advance()
        if info is not None and isinstance(self.model, DistributedDataParallel):
            self.model.buffer_source_rank = info.authority  # not a rank that is only replaying
        super().on_train_batch_start(batch, batch_idx)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        if self._uneven_steps.replaying:
            # Same code, same collectives as a real step, zero gradient from this rank (see uneven.py).
            closure_loss = closure_loss * 0.0
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ---------------------------------------------------------------------- collectives between steps
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """With fault_tolerance, nothing: a barrier cannot tell a slow member from a lost one, and the
        members meet at every step anyway."""
        self._run.barrier(lambda: super(DDPXStrategy, self).barrier(*args, **kwargs))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._run.between_steps(lambda: super(DDPXStrategy, self).broadcast(obj, src), lambda: obj)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return self._run.between_steps(
            lambda: super(DDPXStrategy, self).reduce(tensor, group, reduce_op), lambda: tensor
        )

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return self._run.between_steps(
            lambda: super(DDPXStrategy, self).all_gather(tensor, group, sync_grads),
            lambda: tensor.unsqueeze(0),
        )

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        reached = self._run.between_steps(
            lambda: super(DDPXStrategy, self).reduce_boolean_decision(decision, all), lambda: decision
        )
        return self._run.agree(reached)  # one decision on every member, the reduction failed or not

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """With fault_tolerance, the LightningModule's own step: the wrapper's forward would synchronise
        buffers, a collective outside the training steps the members agree on."""
        return self._run.validation_step(
            lambda: super(DDPXStrategy, self).validation_step(*args, **kwargs),
            lambda: self._own_validation_step(*args, **kwargs),
        )

    def _own_validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.lightning_module is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    # ------------------------------------------------------------------------------ forward / backward
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        if (
            isinstance(self.model, DistributedDataParallel)
            and not self.lightning_module.automatic_optimization
        ):
            # Manual optimisation calls manual_backward *inside* training_step, i.e. inside the module's
            # forward, before the forward could arm the reducer. So the forward runs without arming, and each
            # manual_backward arms it (pre_backward), with its own loss.
            with self.model.no_sync():
                return super().training_step(*args, **kwargs)
        if self._sync_blocked:  # a micro-batch that accumulates locally
            return self._run.accumulating_step(
                lambda: super(DDPXStrategy, self).training_step(*args, **kwargs), self.root_device
            )
        return super().training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """In manual optimisation, make this backward synchronise unless sync is blocked."""
        model = self.model
        if not isinstance(model, DistributedDataParallel) or self.lightning_module is None:
            return
        if self.lightning_module.automatic_optimization or self._sync_blocked or not torch.is_grad_enabled():
            return
        # The same two calls the module's forward makes around a synchronising forward: rebuild buckets if
        # due, then arm the reducer (finding unused parameters from the loss, if enabled).
        model.prepare_for_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Log communication statistics when due. Nothing else: our reducer finishes each synchronised
        backward by itself (torch's static-graph first-iteration flush that Lightning's DDPStrategy performs
        here does not apply)."""
        if self.comm_stats_every_n_steps:
            self._log_comm_stats()

    def _log_comm_stats(self) -> None:
        model, module = self.model, self.lightning_module
        if (
            not isinstance(model, DistributedDataParallel)
            or module is None
            or lightning_compat.trainer_of(module) is None
        ):
            return
        synced = model.synchronised_steps
        if synced == 0 or synced % self.comm_stats_every_n_steps:
            return
        summary = model.take_comm_stats()
        if summary is None:  # nothing synchronised since the last log (an accumulation backward after it)
            return
        trainer = lightning_compat.trainer_of(module)
        for logger in trainer.loggers:  # rank-zero-only loggers write rank 0's figures
            logger.log_metrics(summary.as_metrics(), step=trainer.global_step)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients locally (gradient accumulation, ``toggle_model``)."""
        if not isinstance(self.model, DistributedDataParallel):
            yield
            return
        self._sync_blocked += 1
        try:
            with self.model.no_sync():
                yield
        finally:
            self._sync_blocked -= 1

    # ----------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Add every rank's hook state, then let rank 0 write. Lightning calls this on every rank.

        Also after ``fit`` (``trainer.save_checkpoint`` once training ended): the state outlives the module.
        Weights-only checkpoints (no optimizer states) stay weights only.
        """
        # a diverged run must not be saved as rank 0's weights
        self._replicas.before_save(self._our_model(), around=self._run.verification)
        self._run.save_checkpoint(
            checkpoint,
            lambda: self._add_ddpx_state(checkpoint),
            lambda: super(DDPXStrategy, self).save_checkpoint(
                checkpoint, filepath, storage_options=storage_options
            ),
        )

    def _add_ddpx_state(self, checkpoint: dict[str, Any]) -> None:
        """Every rank's replica with parameter averaging, and the hook's state (its entry)."""
        if self._averaging is not None and "optimizer_states" in checkpoint and dist.is_initialized():
            self._add_local_replicas(checkpoint)
        if self._hook_registered and "optimizer_states" in checkpoint and dist.is_initialized():
            # After fit the module is unwrapped; the hook state and the bucket layout it is keyed by were kept
            # at teardown, so a checkpoint saved then resumes exactly too.
            if isinstance(self.model, DistributedDataParallel):
                layout = self.model.reducer_state_dict()
            else:
                layout = self._final_bucket_layout
            entry = self.ddpx_config.hook_entry(self._hook_state, dist.group.WORLD, layout)
            if entry is not None:
                checkpoint[checkpoint_state.CHECKPOINT_KEY] = entry

    @override
    def remove_checkpoint(self, filepath: PATH) -> None:
        """With fault_tolerance, voted on as a save is: a file ModelCheckpoint drops from its top-k is
        removed by whichever process is rank 0 once every member agreed, not left behind by a lost one."""
        self._run.remove_checkpoint(lambda: super(DDPXStrategy, self).remove_checkpoint(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load as usual; keep the hook entry until the hook exists (``setup`` runs after loading)."""
        checkpoint = super().load_checkpoint(
            checkpoint_path, **lightning_compat.weights_only_argument(weights_only)
        )
        self._run.load_checkpoint(checkpoint, lambda: self._take_ddpx_state(checkpoint))
        return checkpoint

    def _take_ddpx_state(self, checkpoint: dict[str, Any]) -> None:
        self._take_local_replica(checkpoint)
        self._pending_hook_entry = (checkpoint.get(checkpoint_state.CHECKPOINT_KEY),)
        if isinstance(self.model, DistributedDataParallel):  # already set up: apply now
            self._restore_hook_state()

    def _add_local_replicas(self, checkpoint: dict[str, Any]) -> None:
        """Post-local SGD: every rank's weights and optimizer state (see :mod:`lightning_ddpx.lightning.checkpoints.local_replicas`)."""
        if not local_replicas.replicas_may_differ(self._hook_state, averaging=True):
            return
        mine = {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint["optimizer_states"]}
        replicas = local_replicas.gather_replicas(mine, dist.group.WORLD)
        if replicas is not None:
            checkpoint[local_replicas.REPLICAS_KEY] = replicas

    def _take_local_replica(self, checkpoint: dict[str, Any]) -> None:
        """This rank's own optimizer state replaces rank 0's in ``checkpoint`` (Lightning loads it after
        setup); its weights wait for the module to be wrapped."""
        averaging = (
            post_local_sgd_setup.is_configured(self.post_local_sgd, self.comm_state)
            or self.diloco is not None
        )
        mine = local_replicas.replica_for_rank(
            checkpoint.pop(local_replicas.REPLICAS_KEY, None), self.global_rank, self.world_size, averaging
        )
        self._pending_replica = mine
        if mine is None:
            return
        checkpoint["optimizer_states"] = mine["optimizer_states"]
        if isinstance(self.model, DistributedDataParallel):  # already set up: apply now
            self._restore_local_replica()

    def _restore_local_replica(self) -> None:
        mine, self._pending_replica = self._pending_replica, None
        if mine is not None and self.lightning_module is not None:
            self.lightning_module.load_state_dict(
                mine["state_dict"], strict=self.lightning_module.strict_loading
            )

    def _restore_hook_state(self) -> None:
        pending, self._pending_hook_entry = self._pending_hook_entry, None
        if pending is None:
            return
        assert isinstance(self.model, DistributedDataParallel)
        (entry,) = pending
        self.ddpx_config.restore_hook_entry(self.model, self._hook_state, entry)

    # -------------------------------------------------------------------------------------- teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Keep our message (it names the parameters, the rank and the fix) and, for parameters that got no
        gradient, add the sentence Lightning's DDPStrategy puts in place of torch's message here, which
        users and their tools search for."""
        exception.args = tuple(
            f"{arg}\n{UNUSED_PARAMETERS_HINT}" if isinstance(arg, str) and _UNUSED_PARAMETERS in arg else arg
            for arg in exception.args
        )

    @override
    def teardown(self) -> None:
        log.debug(f"{type(self).__name__}: tearing down")
        pl_module = self.lightning_module
        if self._averaging is not None:
            self._averaging.finish()  # no DiLoCo exchange left in flight when the group goes
        if isinstance(self.model, DistributedDataParallel):
            if not self.model.released:  # a fault-tolerant member whose step failed has no reducer now
                self._final_bucket_layout = self.model.reducer_state_dict()  # for save_checkpoint after fit
            _remove_gradient_hooks(self.model)
            self.model = pl_module  # unwrap
        trainer = lightning_compat.trainer_of(pl_module) if pl_module is not None else None
        layer_sync = lightning_compat.layer_sync(self)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and layer_sync:
            self.model = layer_sync.revert(self.model)
        # Skip DDPStrategy.teardown, which inspects torch's DDP; the rest of the chain is generic.
        ParallelStrategy.teardown(self)
        self._run.close()  # fault tolerance: leaves the run, the membership stops waiting for this process

    # ------------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: lightning_compat.StrategyRegistry) -> None:
        register_strategy_names(cls, strategy_registry, TRAINER_STRATEGY_NAMES)


def _choose_run(config: DDPXConfig) -> TrainerRun:
    """The run of a strategy with ``config``: fault tolerant when ``fault_tolerance`` is set, else plain."""
    options = config.fault_tolerance
    return TrainerRun() if options is None else FaultTolerantTrainerRun(options)


def _remove_gradient_hooks(module: DistributedDataParallel) -> None:
    """Detach the module's reducer from the parameters, so a later fit on the same LightningModule does not
    keep the old reducer (and its bucket buffers) alive through the parameters' gradient hooks."""
    module.close()


DDPXStrategy.register_strategies(StrategyRegistry)
