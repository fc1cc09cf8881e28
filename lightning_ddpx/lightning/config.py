"""The options both ``DDPXStrategy`` classes take (Lightning Trainer and Fabric), and what they do to a model.

One :class:`DDPXConfig` holds the communication hook and the module options, validated when it is built, so
both strategies fail on the same typo with the same message before any process starts. It then does the
work the two strategies share: wrap a module in :class:`lightning_ddpx.DistributedDataParallel` and register
the hook on it (on every device type, CPU included), name the hook for checkpoints, and write or restore the
hook's checkpoint entry with the bucket layout (the entry format is :mod:`lightning_ddpx.lightning.checkpoint_state`'s).
What differs between Trainer and Fabric -- when a model is set up, where the entry sits in the file -- stays
in the strategies.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_ddpx.engine.module import DistributedDataParallel
from lightning_ddpx.hooks import (
    PostLocalSGDOptions,
    PowerSGDOptions,
    available_hooks,
    bf16_compress_wrapper,
    build_comm_hook,
    fp16_compress_wrapper,
)
from lightning_ddpx.lightning import checkpoint_state, optimizer_overlap_setup, post_local_sgd_setup
from lightning_ddpx.lightning.uneven import LockstepLoader, StepQueue, UnevenInputs, check_uneven_inputs

__all__ = ["CommHookFn", "DDPXConfig", "DDPXConfigAttributes", "STRATEGY_NAMES", "register_strategy_names"]

CommHookFn = Callable[[Any, Any], Any]  # hook(state, bucket: GradBucket) -> torch.futures.Future[Tensor]

_WRAPPERS: dict[str, Callable[[CommHookFn], CommHookFn]] = {
    "fp16": fp16_compress_wrapper,
    "bf16": bf16_compress_wrapper,
}
_POWERSGD_HOOKS = ("powersgd", "batched_powersgd")  # the built-in names that take PowerSGDOptions
_OPTIONLESS_HOOKS = ("allreduce", "fp16", "bf16", "noop")  # the built-in names that take none


@dataclass(frozen=True)
class DDPXConfig:
    """Validated DDPX options. Building one raises on any bad option, naming it and the fix.

    ``comm_hook`` given as an import path is imported, ``powersgd`` given as a dict becomes
    :class:`~lightning_ddpx.hooks.PowerSGDOptions`, and the bucket caps become floats.
    """

    # A registered hook name, a callable hook(state, bucket), or its import path; None: mean allreduce.
    comm_hook: Optional[Union[str, CommHookFn]] = None
    # The state passed to a callable comm_hook (named hooks build their own).
    comm_state: Optional[Any] = None
    # "fp16"/"bf16": compress each bucket before the hook, decompress its result.
    comm_wrapper: Optional[Literal["fp16", "bf16"]] = None
    # Options of comm_hook="powersgd"/"batched_powersgd" (a PowerSGDOptions or a dict of its fields).
    powersgd: Optional[Union[PowerSGDOptions, dict[str, Any]]] = None
    # Options of comm_hook="post_local_sgd" (a PostLocalSGDOptions or a dict of its fields).
    post_local_sgd: Optional[Union[PostLocalSGDOptions, dict[str, Any]]] = None
    # Lightning's: average the model every N steps after post-local SGD starts (see post_local_sgd_setup).
    model_averaging_period: Optional[int] = None
    # The rest goes to lightning_ddpx.DistributedDataParallel unchanged.
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = False
    # torch's static_graph: record used parameters in the first iteration, no graph walk afterwards.
    static_graph: bool = False
    # Step the optimizer bucket by bucket inside backward, as each bucket is reduced (optimizer_overlap_setup).
    overlap_optimizer: bool = False
    # torch's init_sync: check the model across ranks and broadcast rank 0's state at construction.
    init_sync: bool = True
    # Ranks with different numbers of training batches: "join" (replay with zero weight until all are done),
    # "error" (raise naming each rank's batch count) or "off" (Lightning's ddp: a hang). See uneven-inputs.md.
    uneven_inputs: UnevenInputs = "join"

    def __post_init__(self) -> None:
        _check_bucket_caps(self.bucket_cap_mb, self.first_bucket_cap_mb)
        check_uneven_inputs(self.uneven_inputs)
        comm_hook = _resolve_comm_hook(self.comm_hook)
        _check_hook_arguments(comm_hook, self.comm_state, self.comm_wrapper)
        # frozen: normalise through object.__setattr__, once, here
        object.__setattr__(self, "comm_hook", comm_hook)
        object.__setattr__(self, "powersgd", _powersgd_options(comm_hook, self.powersgd))
        object.__setattr__(
            self,
            "post_local_sgd",
            post_local_sgd_setup.resolve_options(
                comm_hook, self.comm_state, self.post_local_sgd, self.model_averaging_period
            ),
        )
        optimizer_overlap_setup.check_option(
            self.overlap_optimizer, post_local_sgd_setup.is_configured(self.post_local_sgd, self.comm_state)
        )
        object.__setattr__(self, "bucket_cap_mb", float(self.bucket_cap_mb))
        object.__setattr__(self, "first_bucket_cap_mb", float(self.first_bucket_cap_mb))

    @property
    def hook_name(self) -> str:
        """How checkpoints identify the hook: ``"powersgd"``, ``"fp16(powersgd)"``, ``"module.function"``."""
        if self.comm_hook is None:
            base = "allreduce"
        elif isinstance(self.comm_hook, str):
            base = self.comm_hook
        else:
            module = getattr(self.comm_hook, "__module__", None)
            qualname = getattr(self.comm_hook, "__qualname__", type(self.comm_hook).__qualname__)
            base = f"{module}.{qualname}" if module else qualname
        return f"{self.comm_wrapper}({base})" if self.comm_wrapper else base

    # ------------------------------------------------------------------------------------------ setup
    def wrap(
        self, module: nn.Module, process_group: Optional[dist.ProcessGroup] = None
    ) -> DistributedDataParallel:
        """``module`` in our data-parallel module with these options; :meth:`register_hook` adds the hook."""
        return DistributedDataParallel(
            module,
            process_group=process_group,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            broadcast_buffers=self.broadcast_buffers,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            init_sync=self.init_sync,
        )

    def wrap_training_loader(
        self, loader: Any, process_group: dist.ProcessGroup, device: Any, steps: StepQueue, for_fabric: bool
    ) -> Any:
        """``loader`` iterated in lockstep across ranks (:mod:`lightning_ddpx.lightning.uneven`), unless
        ``uneven_inputs="off"`` or there is one rank. For the Trainer a collective: every rank calls it."""
        if self.uneven_inputs == "off" or dist.get_world_size(process_group) == 1:
            return loader
        return LockstepLoader(loader, self.uneven_inputs, process_group, device, steps, for_fabric)  # type: ignore[arg-type]

    def register_hook(self, module: DistributedDataParallel) -> Any:
        """Build the hook (a new state per module for named hooks), register it; return its state.

        ``comm_hook=None`` registers nothing: the module's default is torch's mean allreduce, bit for bit.
        """
        if self.comm_hook is None:
            return None
        if isinstance(self.comm_hook, str):
            state, hook = build_comm_hook(
                self.comm_hook,
                process_group=module.process_group,
                powersgd=self.powersgd,
                wrapper=self.comm_wrapper,
                post_local_sgd=self.post_local_sgd,
            )
        else:
            state, hook = post_local_sgd_setup.adopt_torch_state(
                self.comm_state, self.comm_hook, self.model_averaging_period
            )
            if self.comm_wrapper is not None:
                hook = _WRAPPERS[self.comm_wrapper](hook)
        module.register_comm_hook(state, hook)
        return state

    # ------------------------------------------------------------------------------------ checkpoints
    def hook_entry(
        self,
        hook_state: Any,
        group: Optional[dist.ProcessGroup] = None,
        bucket_layout: Optional[dict[str, Any]] = None,
    ) -> Optional[dict[str, Any]]:
        """The checkpoint entry (every rank's hook state, and ``bucket_layout`` if given) on rank 0 of
        ``group``; ``None`` on the other ranks. A collective: every rank must call it.

        ``bucket_layout`` is the module's ``reducer_state_dict()``: rank 0's layout is every rank's (the
        rebuild broadcasts it), and hook state is keyed by bucket, so the resumed run must reduce the same
        buckets from its first step.
        """
        entry = checkpoint_state.gather_entry(hook_state, self.hook_name, group)
        if entry is not None and bucket_layout is not None:
            entry["bucket_layout"] = bucket_layout
        return entry

    def restore_hook_entry(self, module: DistributedDataParallel, hook_state: Any, entry: Any) -> None:
        """Restore ``entry`` (``None``: the checkpoint has none) into ``module``'s layout and ``hook_state``.

        What cannot be restored (other hook, other world size, no entry) is reported once, as a warning: the
        model and optimizer still resume, and fresh hook state costs a few steps of convergence at most.
        """
        _restore_bucket_layout(module, entry)
        restore = checkpoint_state.select_for_rank(
            entry, self.hook_name, checkpoint_state.is_stateful(hook_state), module.rank, module.world_size
        )
        if restore.warning:
            rank_zero_warn(restore.warning)
        checkpoint_state.apply_restore(hook_state, restore)


class _ConfigOption:
    """A read-only strategy attribute that reads the option of the same name from ``strategy.ddpx_config``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, strategy: Any, owner: Optional[type] = None) -> Any:
        return self if strategy is None else getattr(strategy.ddpx_config, self.name)

    def __set__(self, strategy: Any, value: Any) -> None:
        raise AttributeError(
            f"{type(strategy).__name__}.{self.name} is read-only: the options are validated once, when the "
            f"strategy is built. Pass {self.name}=... to {type(strategy).__name__}(...) instead."
        )


class DDPXConfigAttributes:
    """Mixin of both strategies: ``strategy.comm_hook``, ``strategy.powersgd``, ... read ``ddpx_config``,
    so each option lives in one place. Set ``self.ddpx_config`` in ``__init__``."""

    ddpx_config: DDPXConfig
    comm_hook = _ConfigOption()
    comm_state = _ConfigOption()
    comm_wrapper = _ConfigOption()
    powersgd = _ConfigOption()
    post_local_sgd = _ConfigOption()
    model_averaging_period = _ConfigOption()
    bucket_cap_mb = _ConfigOption()
    first_bucket_cap_mb = _ConfigOption()
    find_unused_parameters = _ConfigOption()
    broadcast_buffers = _ConfigOption()
    gradient_as_bucket_view = _ConfigOption()
    static_graph = _ConfigOption()
    overlap_optimizer = _ConfigOption()
    init_sync = _ConfigOption()
    uneven_inputs = _ConfigOption()
    hook_name = _ConfigOption()


# ---------------------------------------------------------------------------------------- validation
def _check_bucket_caps(bucket_cap_mb: float, first_bucket_cap_mb: float) -> None:
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_cap_mb", first_bucket_cap_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"DDPXStrategy: {name} must be a positive number of MiB, got {value!r}.")


def _check_hook_arguments(comm_hook: Any, comm_state: Any, comm_wrapper: Any) -> None:
    if comm_wrapper is not None and comm_wrapper not in _WRAPPERS:
        raise ValueError(
            f"DDPXStrategy: comm_wrapper must be one of {sorted(_WRAPPERS)} or None, got {comm_wrapper!r}."
        )
    if comm_hook is None:
        if comm_wrapper is not None:
            raise ValueError(
                f"DDPXStrategy: comm_wrapper={comm_wrapper!r} wraps a hook, but comm_hook is None. For compressed "
                f"allreduce use comm_hook={comm_wrapper!r}; to compress another hook name it, e.g. "
                f"comm_hook='powersgd', comm_wrapper={comm_wrapper!r}."
            )
        if comm_state is not None:
            raise ValueError(
                "DDPXStrategy: comm_state is given but comm_hook is None; pass the hook it belongs to."
            )
        return
    if isinstance(comm_hook, str):  # a registered name (_resolve_comm_hook imported anything else)
        if comm_state is not None:
            raise ValueError(
                f"DDPXStrategy: comm_state is for callable hooks; the named hook {comm_hook!r} builds its own state "
                "(configure PowerSGD through powersgd=..., post-local SGD through post_local_sgd=...)."
            )
        return
    if not callable(comm_hook):
        raise TypeError(
            f"DDPXStrategy: comm_hook must be a registered name or a callable hook(state, bucket), got "
            f"{type(comm_hook).__name__}."
        )


def _resolve_comm_hook(comm_hook: Any) -> Any:
    """A registered name stays a name; any other string is imported as ``package.module.function``.

    Strings are how YAML and command lines name hooks: ``comm_hook: powersgd`` or
    ``comm_hook: torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``.
    """
    if not isinstance(comm_hook, str):
        return comm_hook
    names = available_hooks()
    if comm_hook in names:
        return comm_hook
    unknown = (
        f"DDPXStrategy: unknown comm_hook {comm_hook!r}. Registered names: {', '.join(names)}; or the import "
        "path of a hook(state, bucket) -> torch.futures.Future (e.g. "
        "'torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook'), or the callable itself."
    )
    module_name, _, attribute = comm_hook.rpartition(".")
    if not module_name:
        raise ValueError(unknown)
    try:
        hook = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{unknown} Importing it failed: {error}") from None
    if not callable(hook):
        raise ValueError(f"{unknown} {comm_hook!r} is a {type(hook).__name__}, not a callable.")
    return hook


def _powersgd_options(comm_hook: Any, powersgd: Any) -> Optional[PowerSGDOptions]:
    """Validate ``powersgd`` now (a typo in an option name fails in the constructor) and return the dataclass.

    Parsing is the hooks package's (``PowerSGDOptions.from_dict``); this only adds the check that the options
    go with a hook that takes them.
    """
    if powersgd is None:
        return None
    if not isinstance(comm_hook, str) or comm_hook in (*_OPTIONLESS_HOOKS, post_local_sgd_setup.HOOK_NAME):
        raise ValueError(
            f"DDPXStrategy: powersgd options are given but comm_hook is {comm_hook!r}, which takes none. "
            f"Set comm_hook to one of {list(_POWERSGD_HOOKS)} or drop powersgd=..."
        )
    if isinstance(powersgd, PowerSGDOptions):
        return powersgd
    if isinstance(powersgd, Mapping):
        try:
            return PowerSGDOptions.from_dict(dict(powersgd))
        except (TypeError, ValueError) as error:
            raise type(error)(f"DDPXStrategy: powersgd={dict(powersgd)!r}: {error}") from None
    raise TypeError(
        f"DDPXStrategy: powersgd must be a PowerSGDOptions or a dict of its fields, got {type(powersgd).__name__}."
    )


def _restore_bucket_layout(module: DistributedDataParallel, entry: Any) -> None:
    layout = entry.get("bucket_layout") if isinstance(entry, Mapping) else None
    if layout is None:
        return
    try:
        module.load_reducer_state_dict(layout)
    except (ValueError, KeyError, TypeError) as error:
        rank_zero_warn(
            f"lightning_ddpx: the checkpoint's bucket layout does not fit this model ({error}); buckets are "
            "planned afresh, so stateful hook memory may be reset on the first step."
        )


# The names both strategies register (Trainer's and Fabric's registries): (name, description, arguments).
STRATEGY_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("ddpx", "lightning_ddpx DDP, processes launched as scripts (like 'ddp')", {}),
    ("ddpx_spawn", "lightning_ddpx DDP, processes spawned (like 'ddp_spawn')", {"start_method": "spawn"}),
    (
        "ddpx_find_unused_parameters_true",
        "lightning_ddpx DDP with find_unused_parameters=True",
        {"find_unused_parameters": True},
    ),
    ("ddpx_fp16", "lightning_ddpx DDP with fp16-compressed allreduce", {"comm_hook": "fp16"}),
    ("ddpx_powersgd", "lightning_ddpx DDP with PowerSGD (default options)", {"comm_hook": "powersgd"}),
)


def register_strategy_names(strategy_class: type, registry: Any) -> None:
    """Register :data:`STRATEGY_NAMES` for ``strategy_class`` in a Lightning or Fabric strategy registry."""
    for name, description, init_params in STRATEGY_NAMES:
        # override=True: re-importing (or reloading) lightning_ddpx must not fail on its own names
        registry.register(name, strategy_class, description=description, override=True, **init_params)
