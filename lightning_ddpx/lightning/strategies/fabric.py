"""``DDPXStrategy`` for Lightning Fabric: ``Fabric(strategy="ddpx")`` on lightning_ddpx's module and hooks.

The Fabric twin of :class:`lightning_ddpx.DDPXStrategy` (the Trainer one): the same options, validated and
applied by the same :class:`~lightning_ddpx.lightning.settings.config.DDPXConfig`. Launching and rendezvous stay Fabric's (we
subclass its ``DDPStrategy``). What changes:

- ``fabric.setup(model, ...)`` wraps the model in :class:`lightning_ddpx.DistributedDataParallel` and
  registers the communication hook, on every device type (CPU included);
- ``fabric.no_backward_sync(model)`` uses our module's ``no_sync()`` (gradient accumulation);
- ``fabric.save(path, state)`` adds every rank's hook state (and the bucket layout) of each of our modules in
  ``state``, and ``fabric.load(path, state)`` restores it, so a resumed PowerSGD run continues exactly.

Importing :mod:`lightning_ddpx` registers the names (``"ddpx"``, ``"ddpx_spawn"``, ``"ddpx_powersgd"``, ...)
with Fabric's strategy registry.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as TorchDistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.engine.reducer.comm_stats import CommStatsSummary
from lightning_ddpx.fault.manager import FaultTolerance
from lightning_ddpx.lightning._compat import (
    PATH,
    DDPBackwardSyncControl,
    StrategyRegistry,
    forward_module,
    weights_only_argument,
)
from lightning_ddpx.lightning.checkpoints import local_replicas
from lightning_ddpx.lightning.checkpoints.checkpoint_io import AtomicCheckpointIO
from lightning_ddpx.lightning.checkpoints.checkpoint_state import CHECKPOINT_KEY
from lightning_ddpx.lightning.fault_tolerance.runs import FaultTolerantFabricRun
from lightning_ddpx.lightning.features import optimizer_overlap_setup, post_local_sgd_setup
from lightning_ddpx.lightning.features.replica_verification import ReplicaVerifier
from lightning_ddpx.lightning.features.uneven import StepInfo, StepQueue
from lightning_ddpx.lightning.processes.process_exit import destroy_process_group_at_exit
from lightning_ddpx.lightning.processes.restart_rendezvous import create_default_group
from lightning_ddpx.lightning.runs.fabric_run import FabricRun
from lightning_ddpx.lightning.settings.config import (
    FABRIC_STRATEGY_NAMES,
    DDPXConfig,
    DDPXConfigAttributes,
    ddp_device_ids,
    register_strategy_names,
)
from lightning_ddpx.lightning.settings.ddp_kwargs import build_ddpx_config, torch_ddp_kwargs
from lightning_ddpx.lightning.settings.options import takes_ddpx_options

__all__ = ["DDPXStrategy", "take_comm_stats"]

log = logging.getLogger(__name__)


@takes_ddpx_options("Fabric")
class DDPXStrategy(DDPXConfigAttributes, DDPStrategy):
    """Fabric's multi-process data parallelism with lightning_ddpx's gradient reducer and communication hooks.

    Takes every argument of Fabric's ``DDPStrategy``, torch's DDP keyword arguments (honoured or refused
    with an error, as in the Trainer strategy) and Lightning's ``ddp_comm_hook``/``ddp_comm_state``/
    ``ddp_comm_wrapper`` spellings, plus the options below (declared once for both strategies in
    :mod:`lightning_ddpx.lightning.settings.options`, keyword-only), with the Trainer strategy's meaning and checks.

    Example::

        >>> import lightning as L
        >>> from lightning_ddpx.fabric import DDPXStrategy
        >>> fabric = L.Fabric(accelerator="cpu", devices=2, strategy=DDPXStrategy(comm_hook="fp16"))
        >>> fabric.launch()  # doctest: +SKIP
        >>> model, optimizer = fabric.setup(model, optimizer)  # doctest: +SKIP
        >>> for x, y in fabric.setup_dataloaders(dataloader):  # doctest: +SKIP
        ...     fabric.backward(loss_fn(model(x), y))  # gradients averaged through the hook
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,  # ours (the signature lists them: takes_ddpx_options) and torch DDP's, checked by name
    ) -> None:
        # Validate before Fabric sees the strategy: a typo fails at once, not after launch.
        self.ddpx_config = build_ddpx_config(type(self).__name__, "Fabric", kwargs)
        # how the processes run, chosen once: plain, or fault tolerant (lightning/runs/fabric_run.py)
        self._run = _choose_run(self.ddpx_config)
        cluster_environment = self._run.cluster_environment(cluster_environment)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._ddp_kwargs = torch_ddp_kwargs(kwargs)  # Lightning's attribute: torch DDP's arguments, as given
        self._backward_sync_control = _DDPXBackwardSyncControl()
        # the models whose hook brings parameter averaging (post-local SGD, DiLoCo), in set-up order (the same
        # on every rank: the order of their collectives after a step)
        self._averaged: list[DistributedDataParallel] = []
        self._optimizers: list[Optimizer] = []  # set up with this strategy
        self._uneven_steps = StepQueue(on_push=self._on_batch_fetched)
        self._modules: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
        self._replicas = ReplicaVerifier(self.ddpx_config.verify_replicas_every_n_steps)  # in set-up order

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Fabric's default, made atomic (:class:`~lightning_ddpx.lightning.checkpoints.checkpoint_io.AtomicCheckpointIO`),
        unless a CheckpointIO was given."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------------------------------ setup
    @property
    def fault_manager(self) -> Optional[FaultTolerance]:
        """With fault_tolerance, this training process's part in the run once ``fabric.launch()`` joined it:
        the loop steps through its ``step()`` (docs/fault-tolerance.md); ``None`` otherwise."""
        return self._run.fault

    @override
    def _configure_launcher(self) -> None:
        launcher = self._run.launcher(self, self._start_method)
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
    def _setup_distributed(self) -> None:
        """With fault_tolerance: join the run (its group is the membership's); see docs/fault-tolerance.md."""
        self._run.setup_distributed(self, self._create_default_group, self._get_process_group_backend)

    def _create_default_group(self) -> None:
        self._set_world_ranks()
        # torchrun shares its store across restarts: this round's keys only (lightning.restart_rendezvous)
        create_default_group(
            self.cluster_environment, self._get_process_group_backend(), self._timeout, self.root_device
        )
        super()._setup_distributed()  # Lightning's creation, when that created none

    @override
    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        """Wrap ``module`` (already on its device) in our module and register the hook.

        Each module set up gets its own hook state (for named hooks); ``comm_state`` given with a callable
        hook is shared by all of them.
        """
        log.debug(
            f"{type(self).__name__}: wrapping in lightning_ddpx.DistributedDataParallel, {self.hook_name}"
        )
        wrapped = self._run.wrap(module, self.ddpx_config, ddp_device_ids(self.root_device))
        if wrapped.parameter_averaging is not None:  # post-local SGD, DiLoCo: averaged after the steps
            self._averaged.append(wrapped)
        self._modules.add(wrapped)
        self._replicas.track(wrapped)
        return wrapped

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """With ``overlap_optimizer``: hand the optimizer to the model (set up before) that owns its parameters."""
        if self.overlap_optimizer:
            optimizer_overlap_setup.attach_fabric_optimizer(self._modules, optimizer, self.precision)
        self._run.track_optimizer(optimizer)
        self._optimizers.append(optimizer)  # post-local SGD averages every optimizer's parameters
        return super().setup_optimizer(optimizer)

    @override
    def clip_gradients_norm(
        self, module: nn.Module, optimizer: Optimizer, *args: Any, **kwargs: Any
    ) -> Tensor:
        optimizer_overlap_setup.refuse_clipping(self.overlap_optimizer, "fabric.clip_gradients(max_norm=...)")
        return super().clip_gradients_norm(module, optimizer, *args, **kwargs)

    @override
    def clip_gradients_value(
        self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]
    ) -> None:
        optimizer_overlap_setup.refuse_clipping(self.overlap_optimizer, "fabric.clip_gradients(clip_val=...)")
        return super().clip_gradients_value(module, optimizer, clip_val)

    # ---------------------------------------------------------------------------------- uneven inputs
    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """Loaders are iterated in lockstep across ranks (``uneven_inputs``), except in loops entered with
        gradients disabled (evaluation, possibly on rank 0 alone)."""
        return self._run.process_dataloader(
            dataloader,
            lambda: self.ddpx_config.wrap_training_loader(
                dataloader, dist.group.WORLD, self.root_device, self._uneven_steps, for_fabric=True
            ),
        )

    @property
    def replaying(self) -> bool:
        """Whether the batch just fetched is a replay (this rank ran out, others did not): its backward
        counts zero. Skip metric updates and sample counts on such batches."""
        latest = self._uneven_steps.latest
        return latest is not None and latest.replay

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # ddpx_spawn pickles the strategy; weak references do not pickle
        state["_modules"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._modules = weakref.WeakSet()

    def _on_batch_fetched(self, info: StepInfo) -> None:
        for wrapped in self._modules:  # the next forward broadcasts buffers from a rank with a real batch
            wrapped.buffer_source_rank = info.authority

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self.replaying:
            tensor = tensor * 0.0  # same code and collectives as a real step, zero gradient from this rank
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step; then the parameter averaging (post-local SGD, DiLoCo) of each model the optimizer updates.

        With ``overlap_optimizer``, nothing when the last backward already stepped this optimizer."""
        if self.overlap_optimizer and optimizer_overlap_setup.stepped_in_backward(self._modules, optimizer):
            self._replicas.after_optimizer_step()
            return None
        output = super().optimizer_step(optimizer, **kwargs)
        for module in self._averaged:
            if post_local_sgd_setup.owns_params(module, optimizer):
                post_local_sgd_setup.check_optimizers([optimizer])
                self._run.average_after_step(module, self._optimizers)
        # the verification, when due, is a collective between steps
        self._replicas.after_optimizer_step(around=self._run.verification)
        return output

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The wrapped model's own state dict (no ``module.`` prefix), as Fabric's DDP strategy saves."""
        return super().get_module_state_dict(_unwrap(module))

    @override
    def load_module_state_dict(
        self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True
    ) -> None:
        super().load_module_state_dict(_unwrap(module), state_dict, strict=strict)

    # ----------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(
        self,
        path: PATH,
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Add ``state[key]``'s hook entry for each of our modules in ``state``, then let rank 0 write.

        The entries go under ``checkpoint["lightning_ddpx"][key]`` (``key``: the model's key in ``state``),
        each in the Trainer strategy's entry format. Fabric calls this on every rank, as gathering needs.
        """
        state = self._run.state_to_save(state, lambda: self._with_our_state(state))
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def _with_our_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with each of our modules' hook entry and, with parameter averaging, every rank's replica
        (on rank 0, which writes); the replicas verified first when due."""
        modules = _our_modules(state)
        self._replicas.before_save(modules.values())  # a diverged run must not be saved as rank 0's weights
        if not modules:
            return state
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"DDPXStrategy: fabric.save got a state with the key {CHECKPOINT_KEY!r}, which holds the "
                "communication-hook state of the models in the checkpoint. Rename that entry of your state."
            )
        entries = {
            key: self.ddpx_config.hook_entry(
                module.comm_hook_state, module.process_group, module.reducer_state_dict()
            )
            for key, module in modules.items()
        }
        replicas = self._local_replicas(state, modules)
        if not self.is_global_zero:
            return state
        state = {**state, CHECKPOINT_KEY: entries}
        if replicas is not None:
            state[local_replicas.REPLICAS_KEY] = replicas
        return state

    @override
    def load_checkpoint(
        self,
        path: PATH,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Load as Fabric does, then restore each of our modules' hook state and bucket layout.

        A model whose entry is missing (a checkpoint of another strategy) or does not fit (another hook,
        another world size) resumes with fresh hook state and a warning, as in the Trainer strategy.
        """
        remainder = super().load_checkpoint(path, state, strict=strict, **weights_only_argument(weights_only))
        self._run.load_checkpoint(remainder, lambda: self._restore_our_state(remainder, state, strict))
        return remainder

    def _restore_our_state(self, remainder: dict[str, Any], state: Any, strict: bool) -> None:
        modules = _our_modules(state) if isinstance(state, Mapping) else {}
        if not modules:
            return
        entries = remainder.pop(CHECKPOINT_KEY, None)
        for key, module in modules.items():
            entry = entries.get(key) if isinstance(entries, Mapping) else None
            self.ddpx_config.restore_hook_entry(module, module.comm_hook_state, entry)
        replicas = remainder.pop(local_replicas.REPLICAS_KEY, None)
        mine = local_replicas.replica_for_rank(
            replicas, self.global_rank, self.world_size, averaging=bool(self._averaged)
        )
        for key, replica in (mine or {}).items():  # post-local SGD: this rank's own weights and optimizer
            target = state[key] if isinstance(state, Mapping) and key in state else None
            if isinstance(target, nn.Module):
                self.load_module_state_dict(target, replica, strict=strict)
            elif isinstance(target, Optimizer):
                target.load_state_dict(replica)

    def _local_replicas(
        self, state: Mapping[str, Any], modules: Mapping[str, DistributedDataParallel]
    ) -> Optional[list[Any]]:
        """Post-local SGD: every rank's modules and optimizers of ``state``, on rank 0 (a collective; see
        :mod:`lightning_ddpx.lightning.checkpoints.local_replicas`). ``None`` while the replicas are still identical."""
        averaged = {id(module) for module in self._averaged}
        if not any(
            local_replicas.replicas_may_differ(module.comm_hook_state, id(module) in averaged)
            for module in modules.values()
        ):
            return None
        mine = {
            key: self.get_module_state_dict(obj)
            if isinstance(obj, nn.Module)
            else self.get_optimizer_state(obj)
            for key, obj in state.items()
            if isinstance(obj, (nn.Module, Optimizer))
        }
        return local_replicas.gather_replicas(mine)

    # -------------------------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        """Close every model this strategy set up (gradient hooks removed, its threads ended), then Fabric's
        teardown. Fabric itself does not call this; code that ends a run with ``strategy.teardown()`` (as
        for the Trainer strategy) leaves no lightning_ddpx thread behind. The models' weights stay usable;
        training them further needs a new ``fabric.setup``."""
        for module in list(self._modules):
            module.close()
        self._modules = weakref.WeakSet()
        self._averaged.clear()
        self._optimizers.clear()
        self._replicas = ReplicaVerifier(
            self.ddpx_config.verify_replicas_every_n_steps
        )  # closed ones forgotten
        super().teardown()
        self._run.close()  # fault tolerance: leaves the run

    # ---------------------------------------------------------------------- collectives between steps
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """With fault_tolerance, nothing: a barrier cannot tell a slow member from a lost one."""
        self._run.barrier(lambda: super(DDPXStrategy, self).barrier(*args, **kwargs))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._run.between_steps(lambda: super(DDPXStrategy, self).broadcast(obj, src), obj)

    @override
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return self._run.between_steps(
            lambda: super(DDPXStrategy, self).all_reduce(tensor, group, reduce_op), tensor
        )

    # ------------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register_strategy_names(cls, strategy_registry, FABRIC_STRATEGY_NAMES)


def _choose_run(config: DDPXConfig) -> FabricRun:
    """The run of a strategy with ``config``: fault tolerant when ``fault_tolerance`` is set, else plain."""
    options = config.fault_tolerance
    return FabricRun() if options is None else FaultTolerantFabricRun(options)


class _DDPXBackwardSyncControl(DDPBackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the module's ``no_sync()``; wrap the forward too.

    A subclass of Fabric's DDP sync control, so code checking for it accepts ours. A module wrapped in
    torch's ``DistributedDataParallel`` is accepted too: its ``no_sync()`` is the right call for it.
    """

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, (DistributedDataParallel, TorchDistributedDataParallel)):
            raise TypeError(
                "DDPXStrategy: blocking backward sync is only possible if the module passed to "
                f"`{type(self).__name__}.no_backward_sync` is wrapped in `DistributedDataParallel` "
                f"(lightning_ddpx's, by fabric.setup); got {type(module).__name__}. Call "
                "model = fabric.setup(model, ...) first and pass that model to fabric.no_backward_sync."
            )
        return module.no_sync()


def take_comm_stats(model: nn.Module) -> CommStatsSummary | None:
    """Per-step communication statistics since the last call, for a model returned by ``fabric.setup``.

    Fabric's loggers belong to the ``Fabric`` object, not to the strategy, so the loop logs them:
    ``fabric.log_dict(stats.as_metrics())``. ``None`` if no step synchronised since the last call.
    """
    ours = forward_module(model)  # fabric.setup wraps our module in a _FabricModule
    if not isinstance(ours, DistributedDataParallel):
        raise TypeError(
            f"take_comm_stats needs a model set up by Fabric with lightning_ddpx's DDPXStrategy, got a "
            f"{type(ours).__name__}."
        )
    return ours.take_comm_stats()


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _our_modules(state: Any) -> dict[str, DistributedDataParallel]:
    """The top-level entries of a ``fabric.save``/``fabric.load`` state that are our modules, in order."""
    if not isinstance(state, Mapping):
        return {}
    return {key: obj for key, obj in state.items() if isinstance(obj, DistributedDataParallel)}


DDPXStrategy.register_strategies(STRATEGY_REGISTRY)
