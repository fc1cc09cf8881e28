"""The options both ``DDPXStrategy`` classes take (Lightning Trainer and Fabric), and what they do to a model.

One :class:`DDPXConfig` holds the communication hook and the module options, validated when it is built, so
both strategies fail on the same typo with the same message before any process starts. It then does the
work the two strategies share: wrap a module in :class:`lightning_ddpx.DistributedDataParallel` and register
the hook on it (on every device type, CPU included), name the hook for checkpoints, and write or restore the
hook's checkpoint entry with the bucket layout (the entry format is :mod:`lightning_ddpx.lightning.checkpoints.checkpoint_state`'s).
What differs between Trainer and Fabric -- when a model is set up, where the entry sits in the file -- stays
in the strategies.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_ddpx.engine.buckets.grad_bucket import CommHook
from lightning_ddpx.engine.buckets.plan import is_bucket_cap
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.engine.option_values import check_flags, check_int
from lightning_ddpx.engine.transport.transports import hook_name
from lightning_ddpx.fault.options import FaultToleranceOptions
from lightning_ddpx.hooks import DiLoCoOptions, PostLocalSGDOptions, PowerSGDOptions
from lightning_ddpx.hooks.registry import (
    available_hooks,
    build_comm_hook,
    builtin_hooks,
    hook_entry,
    hooks_taking,
    wrap_hook,
    wrapper_names,
)
from lightning_ddpx.lightning.checkpoints import checkpoint_state
from lightning_ddpx.lightning.features import (
    diloco_setup,
    optimizer_overlap_setup,
    post_local_sgd_setup,
    replica_verification,
)
from lightning_ddpx.lightning.features.uneven import (
    LockstepLoader,
    StepQueue,
    UnevenInputs,
    check_uneven_inputs,
)
from lightning_ddpx.lightning.settings import fault_tolerance_options

__all__ = [
    "FABRIC_STRATEGY_NAMES",
    "TRAINER_STRATEGY_NAMES",
    "DDPXConfig",
    "DDPXConfigAttributes",
    "register_strategy_names",
    "resolve_comm_hook",
]

# The arguments that carry a named hook's options -> build_comm_hook's keyword for them (the registry's
# ``HookEntry.keyword``, which decides which hook takes which). The built-ins' are spelled alike; a hook
# registered by the user (register_hook_name(..., options_type=...)) takes comm_hook_options.
_OPTIONS_ARGUMENTS = {
    "powersgd": "powersgd",
    "post_local_sgd": "post_local_sgd",
    "diloco": "diloco",
    "comm_hook_options": "options",
}

# The wrapper names the registry declares, for LightningCLI's choices.
_WrapperName = Literal[tuple(wrapper_names())]  # type: ignore[valid-type]


def _option(
    default: Any,
    doc: str,
    *,
    check: Optional[Callable[[Any], None]] = None,
    strategies: tuple[str, ...] = ("Trainer", "Fabric"),
    fabric_doc: Optional[str] = None,
) -> Any:
    """Declare one option: its default, what it does (the strategies' docstrings and the docs tables are
    made from ``doc``; see :mod:`lightning_ddpx.lightning.settings.options`), its own check, which strategies take it."""
    metadata = {"doc": doc, "check": check, "strategies": strategies, "fabric_doc": fabric_doc}
    return field(default=default, metadata=metadata)


def _positive_megabytes(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not is_bucket_cap(value):
            raise ValueError(
                f"DDPXStrategy: {name} must be a positive number of MiB or None (torch's default), at least one "
                f"byte and finite, got {value!r}."
            )

    return check


def _flag(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        check_flags("DDPXStrategy", {name: value})

    return check


def _steps(name: str, counted: str, none_means: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        check_int(
            "DDPXStrategy", name, value, 1, optional=True, hint=f"It counts {counted}; None: {none_means}."
        )

    return check


@dataclass(frozen=True)
class DDPXConfig:
    """Validated DDPX options. Building one raises on any bad option, naming it and the fix.

    ``comm_hook`` given as an import path is imported, options given as a dict (``powersgd``,
    ``post_local_sgd``, ``diloco``, ``comm_hook_options``) become the options type the hook registry declares
    for the hook (:class:`~lightning_ddpx.hooks.PowerSGDOptions`, ...), and the bucket caps become floats.
    """

    comm_hook: Optional[Union[str, CommHook]] = _option(
        None,
        f"a registered hook name ({', '.join(f'``{name}``' for name in builtin_hooks())}, or one added with "
        "``lightning_ddpx.hooks.register_hook_name``), a callable ``hook(state, bucket) -> Future[Tensor]`` such "
        "as torch's ``ddp_comm_hooks``, or its import path as a string (how YAML names one). ``None``: plain mean "
        "allreduce, bit for bit torch's default.",
    )
    comm_state: Optional[Any] = _option(
        None,
        "the state passed to a callable ``comm_hook`` (e.g. a process group, or an object with "
        "``state_dict()``/``load_state_dict()`` to be checkpointed). Named hooks build their own.",
    )
    comm_wrapper: Optional[_WrapperName] = _option(
        None,
        '``"fp16"`` or ``"bf16"``: cast each bucket before the hook and its result back (e.g. '
        '``comm_hook="powersgd", comm_wrapper="fp16"``).',
    )
    powersgd: Optional[Union[PowerSGDOptions, dict[str, Any]]] = _option(
        None,
        'PowerSGD options for ``comm_hook="powersgd"``/``"batched_powersgd"``, as a ``PowerSGDOptions`` or a '
        'dict of its fields (``{"matrix_approximation_rank": 4}``). See docs/hooks.md.',
    )
    post_local_sgd: Optional[Union[PostLocalSGDOptions, dict[str, Any]]] = _option(
        None,
        'options of ``comm_hook="post_local_sgd"`` (``start_localSGD_iter``, ``period``, ``subgroup``, '
        "``hierarchy``, ``post_local_gradient_allreduce``), as a ``PostLocalSGDOptions`` or a dict. See "
        "docs/hooks.md (post-local SGD).",
    )
    model_averaging_period: Optional[int] = _option(
        None,
        "Lightning's: with post-local SGD (the named hook, or torch's or our ``PostLocalSGDState`` as "
        "``comm_state``), average the parameters every N optimizer steps from ``start_localSGD_iter`` on.",
        check=_steps("model_averaging_period", "optimizer steps", "the post-local SGD state's own period"),
        fabric_doc="as in the Trainer strategy: after each ``optimizer.step()`` of an optimizer that holds a "
        "post-local SGD model's parameters, those parameters are averaged when due; ``fabric.save``/"
        "``fabric.load`` keep the hook's iteration, the averager's step and every rank's own weights.",
    )
    diloco: Optional[Union[DiLoCoOptions, dict[str, Any]]] = _option(
        None,
        'options of ``comm_hook="diloco"``: ``period`` (H, inner steps between syncs), ``outer_lr``, '
        "``outer_momentum``, ``nesterov``, ``fragments`` and ``overlap_steps`` (streaming DiLoCo), ``mixing``, "
        '``precision`` of the outer exchange (``"fp32"``, ``"bf16"``, ``"fp16"``, or quantized ``"int8"``, '
        '``"int4"``), or ``sparse`` (a dict of ``density``, ``bits``, ``chunk``, ``error_decay``: the top-k of '
        "each chunk in 2, 4 or 8 bits with error feedback), as a ``DiLoCoOptions`` or a dict. See docs/diloco.md.",
    )
    comm_hook_options: Optional[dict[str, Any]] = _option(
        None,
        "options of a hook you registered with ``lightning_ddpx.hooks.register_hook_name(name, factory, "
        "options_type=...)``, named by ``comm_hook=name``: a dict of the options type's fields (or an instance "
        "of it), parsed and type-checked when the strategy is built and passed to ``factory(process_group, "
        "options)``; every rank must give the same. See docs/hooks.md (your own hook).",
    )
    bucket_cap_mb: Optional[float] = _option(
        None,
        "gradient bucket size in MiB. ``None``: torch's default, 25 MiB after a 1 MiB first bucket; a number "
        "sizes every bucket, the first included (torch's rule).",
        check=_positive_megabytes("bucket_cap_mb"),
    )
    first_bucket_cap_mb: Optional[float] = _option(
        None,
        "size of the first bucket launched, so communication starts early. ``None``: torch's rule (1 MiB "
        "when ``bucket_cap_mb`` is ``None``, else ``bucket_cap_mb``).",
        check=_positive_megabytes("first_bucket_cap_mb"),
    )
    find_unused_parameters: bool = _option(
        False,
        "allow parameters that get no gradient in an iteration (walks the autograd graph each step).",
        check=_flag("find_unused_parameters"),
    )
    broadcast_buffers: bool = _option(
        True,
        "copy rank 0's buffers (e.g. BatchNorm statistics) to every rank before each synchronised forward.",
        check=_flag("broadcast_buffers"),
    )
    gradient_as_bucket_view: bool = _option(
        False,
        "make ``param.grad`` views into the buckets (less memory, one copy fewer per step).",
        check=_flag("gradient_as_bucket_view"),
    )
    static_graph: bool = _option(
        False,
        "torch's: the first synchronised iteration records which parameters get gradients (and how often); "
        "afterwards no autograd-graph walk per step. See docs/engine.md (static graph).",
        check=_flag("static_graph"),
    )
    overlap_optimizer: bool = _option(
        False,
        "step the optimizer bucket by bucket inside backward, as each bucket's reduced gradients arrive, while "
        "later buckets still communicate (the same parameters as the plain step). torch's per-parameter "
        "optimizers only; refuses gradient clipping, a GradScaler, manual optimisation and post-local SGD. See "
        "docs/engine.md (optimizer overlap).",
        fabric_doc="as in the Trainer strategy, for the optimizer given to ``fabric.setup(model, optimizer)``: "
        "``optimizer.step()`` after an overlapped backward does nothing (the buckets stepped already); "
        "``fabric.clip_gradients`` is refused. See docs/engine.md (optimizer overlap).",
    )
    init_sync: bool = _option(
        True,
        "torch's: check the model across ranks and broadcast rank 0's parameters and buffers at "
        "construction. ``False`` skips both (the ranks must already agree).",
        check=_flag("init_sync"),
    )
    uneven_inputs: UnevenInputs = _option(
        "join",
        "ranks with different numbers of training batches (an IterableDataset, "
        '``use_distributed_sampler=False``, a custom sampler): ``"join"`` keeps every rank stepping until the '
        'last runs out (ranks that ran out replay a batch with zero weight), ``"error"`` raises on every rank '
        "naming each rank's batch count, ``\"off\"`` does nothing (a hang, as with Lightning's ``ddp``). See "
        "docs/uneven-inputs.md.",
        check=check_uneven_inputs,
        fabric_doc="as in the Trainer strategy, for the loaders given to ``fabric.setup_dataloaders`` when "
        "iterated with gradients enabled (Fabric cannot tell training from evaluation loaders; a loop under "
        '``torch.no_grad()`` is left alone): ``"join"``, ``"error"`` or ``"off"``. See docs/uneven-inputs.md.',
    )
    comm_stats_every_n_steps: Optional[int] = _option(
        None,
        "log communication statistics (bytes to the hook and sent, compression ratio, time in hooks, exposed "
        "communication; per-step means, rank 0's) to the Trainer's loggers under ``ddpx/`` every N "
        "synchronised steps. ``None``: nothing is logged.",
        check=_steps("comm_stats_every_n_steps", "synchronised steps", "nothing is logged"),
        strategies=("Trainer",),  # Fabric has no step loop to log from: fabric.take_comm_stats(model) instead
    )

    verify_replicas_every_n_steps: Optional[int] = _option(
        None,
        "compare every rank's parameters bitwise every N optimizer steps and before each checkpoint is saved "
        "(a digest per parameter, one small ``all_gather``); a mismatch raises on every rank naming the first "
        "differing parameter, the ranks and the step. ``None``: never. See docs/engine.md (replica "
        "verification).",
        check=_steps("verify_replicas_every_n_steps", "optimizer steps", "no verification"),
        fabric_doc="as in the Trainer strategy: every N ``optimizer.step()`` calls of optimizers set up by Fabric, "
        "and in ``fabric.save``, for every model set up by this strategy. See docs/engine.md (replica "
        "verification).",
    )

    fault_tolerance: Optional[Union[bool, FaultToleranceOptions, dict[str, Any]]] = _option(
        None,
        "off unless given (``None``/``False``). With it, a lost training process does not end the run: the others discard the step in flight and go on, and "
        'a replacement (``{"replacements": 1}``) is healed from a live peer. ``True``, or a dict of '
        "``FaultToleranceOptions`` (``min_ranks``, ``replacements``, ``heartbeat_timeout_s``, "
        "``collective_timeout_s``, ``join_timeout_s``). gloo only; see docs/fault-tolerance.md for what it "
        "supports and refuses.",
        fabric_doc="as in the Trainer strategy; the loop uses ``fabric.strategy.fault_manager`` (its "
        "``step()`` decides whether to apply each step). See docs/fault-tolerance.md.",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "fault_tolerance", FaultToleranceOptions.of(self.fault_tolerance))
        for f in fields(self):  # each option's own check, declared with it
            check = f.metadata.get("check")
            if check is not None:
                check(getattr(self, f.name))
        comm_hook = resolve_comm_hook(self.comm_hook)
        _check_hook_arguments(comm_hook, self.comm_state, self.comm_wrapper)
        # frozen: normalise through object.__setattr__, once, here
        object.__setattr__(self, "comm_hook", comm_hook)
        given = {argument: getattr(self, argument) for argument in _OPTIONS_ARGUMENTS}
        for argument, options in _parse_hook_options(comm_hook, given).items():
            object.__setattr__(self, argument, options)
        object.__setattr__(
            self,
            "post_local_sgd",
            post_local_sgd_setup.resolve_options(
                comm_hook, self.comm_state, self.post_local_sgd, self.model_averaging_period
            ),
        )
        object.__setattr__(
            self, "diloco", diloco_setup.resolve_options(comm_hook, self.diloco, self.comm_wrapper)
        )
        optimizer_overlap_setup.check_option(
            self.overlap_optimizer,
            post_local_sgd_setup.is_configured(self.post_local_sgd, self.comm_state)
            or self.diloco is not None,
        )
        replica_verification.check_option(
            self.verify_replicas_every_n_steps,
            "post-local SGD"
            if post_local_sgd_setup.is_configured(self.post_local_sgd, self.comm_state)
            else "DiLoCo"
            if self.diloco is not None
            else None,
        )
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.fault_tolerance is not None:
            fault_tolerance_options.check_options(self)

    @property
    def hook_name(self) -> str:
        """How checkpoints identify the hook: ``"powersgd"``, ``"fp16(powersgd)"``, ``"module.function"``."""
        if self.comm_hook is None:
            base = "allreduce"
        elif isinstance(self.comm_hook, str):
            base = self.comm_hook
        else:
            base = hook_name(self.comm_hook)
        return f"{self.comm_wrapper}({base})" if self.comm_wrapper else base

    # ------------------------------------------------------------------------------------------ setup
    def wrap(
        self,
        module: nn.Module,
        process_group: Optional[dist.ProcessGroup] = None,
        device_ids: Optional[list[int]] = None,
        init_sync: Optional[bool] = None,
    ) -> DistributedDataParallel:
        """``module`` in our data-parallel module with these options; :meth:`register_hook` adds the hook.

        ``device_ids``: what Lightning's DDP strategies pass torch's DDP (:func:`ddp_device_ids`).
        ``init_sync``: overrides the option (a fault-tolerant run's newcomer is healed later instead).
        """
        wrapped = DistributedDataParallel(
            module,
            device_ids=device_ids,
            process_group=process_group,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            forward_sync_buffers=self.broadcast_buffers,  # the strategies: buffers always synced at wrap
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            init_sync=self.init_sync if init_sync is None else init_sync,
        )
        # options that add collectives outside the module, and a user's hook options (the built-ins' are their
        # state's): every rank must have them alike
        wrapped.driver_settings = {
            name: repr(getattr(self, name))
            for name in ("uneven_inputs", "verify_replicas_every_n_steps", "comm_hook_options")
        }
        return wrapped

    def wrap_training_loader(
        self, loader: Any, process_group: dist.ProcessGroup, device: Any, steps: StepQueue, for_fabric: bool
    ) -> Any:
        """``loader`` iterated in lockstep across ranks (:mod:`lightning_ddpx.lightning.features.uneven`), unless
        ``uneven_inputs="off"`` or there is one rank. For the Trainer a collective: every rank calls it."""
        if self.uneven_inputs == "off" or dist.get_world_size(process_group) == 1:
            return loader
        return LockstepLoader(loader, self.uneven_inputs, process_group, device, steps, for_fabric)  # type: ignore[arg-type]

    def register_hook(self, module: DistributedDataParallel, follow_default_group: bool = False) -> Any:
        """Build the hook (a new state per module for named hooks), register it; return its state.

        ``comm_hook=None`` registers nothing: the module's default is torch's mean allreduce, bit for bit.
        A state that brings parameter averaging (post-local SGD, DiLoCo) is bound to the module by the
        registration; the module runs it at ``average_parameters_after_step()``. ``follow_default_group``: a
        named hook's state uses the default group of the moment instead of the module's group now (fault
        tolerance builds a new default group for each membership).
        """
        if self.comm_hook is None:
            return None
        if isinstance(self.comm_hook, str):
            options = {keyword: getattr(self, argument) for argument, keyword in _OPTIONS_ARGUMENTS.items()}
            group = None if follow_default_group else module.process_group
            state, hook = build_comm_hook(
                self.comm_hook, process_group=group, wrapper=self.comm_wrapper, **options
            )
        else:
            state, hook = post_local_sgd_setup.adopt_torch_state(
                self.comm_state, self.comm_hook, self.model_averaging_period
            )
            if self.comm_wrapper is not None:
                hook = wrap_hook(hook, self.comm_wrapper)
        module.register_comm_hook(state, hook)
        post_local_sgd_setup.complete_averaging(module, state, self.model_averaging_period)
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


def ddp_device_ids(root_device: torch.device) -> Optional[list[int]]:
    """torch's ``device_ids`` for a process's model, as Lightning's DDP strategies decide them: ``None`` on the
    CPU, ``[index]`` on an accelerator (forward then moves inputs there, a no-op for Lightning's batches,
    which are already on it)."""
    return None if root_device.type == "cpu" else [root_device.index]


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
    """Mixin of both strategies: ``strategy.comm_hook``, ``strategy.powersgd``, ... (one read-only attribute per
    :class:`DDPXConfig` field, made below) read ``ddpx_config``, so each option lives in one place. Set
    ``self.ddpx_config`` in ``__init__``."""

    ddpx_config: DDPXConfig
    hook_name = _ConfigOption()


for _field in fields(DDPXConfig):
    _attribute = _ConfigOption()
    _attribute.__set_name__(DDPXConfigAttributes, _field.name)
    setattr(DDPXConfigAttributes, _field.name, _attribute)
del _field, _attribute


# ---------------------------------------------------------------------------------------- validation
def _check_hook_arguments(comm_hook: Any, comm_state: Any, comm_wrapper: Any) -> None:
    if comm_wrapper is not None and comm_wrapper not in wrapper_names():
        raise ValueError(
            f"DDPXStrategy: comm_wrapper must be one of {wrapper_names()} or None, got {comm_wrapper!r}."
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
    if isinstance(comm_hook, str):  # a registered name (resolve_comm_hook imported anything else)
        if comm_state is not None:
            entry = hook_entry(comm_hook)
            configure = (
                f"configure it through {_argument_for(entry.keyword)}=..."
                if entry is not None and entry.options_type is not None
                else "it takes no options"
            )
            raise ValueError(
                f"DDPXStrategy: comm_state is for callable hooks; the named hook {comm_hook!r} builds its own state "
                f"({configure})."
            )
        return
    if not callable(comm_hook):
        raise TypeError(
            f"DDPXStrategy: comm_hook must be a registered name or a callable hook(state, bucket), got "
            f"{type(comm_hook).__name__}."
        )


def resolve_comm_hook(comm_hook: Any) -> Any:
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


def _parse_hook_options(comm_hook: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` (:data:`_OPTIONS_ARGUMENTS` -> value) with each value parsed into the options type of
    ``comm_hook``'s registry entry, now (a typo fails in the constructor). Options the hook does not take are
    refused, naming the hooks that take them: which hook takes which is the registry's (``HookEntry.takes``)."""
    entry = hook_entry(comm_hook)
    parsed = dict(given)
    for argument, options in given.items():
        if options is None:
            continue
        if entry is None or not entry.takes(_OPTIONS_ARGUMENTS[argument]):
            raise ValueError(_options_not_taken(comm_hook, entry, argument))
        try:
            parsed[argument] = entry.parse(comm_hook, options)
        except (TypeError, ValueError) as error:
            raise type(error)(f"DDPXStrategy: {argument}={options!r}: {error}") from None
    return parsed


def _options_not_taken(comm_hook: Any, entry: Any, argument: str) -> str:
    what = argument if argument == "comm_hook_options" else f"{argument} options"
    callable_hook = comm_hook is not None and not isinstance(comm_hook, str)
    hook = f"the callable {hook_name(comm_hook)}" if callable_hook else repr(comm_hook)
    own = entry is not None and entry.options_type is not None
    takes = f"no {what} (its own go in {_argument_for(entry.keyword)}=...)" if own else "none"
    takers = hooks_taking(_OPTIONS_ARGUMENTS[argument])
    if callable_hook and argument == "comm_hook_options":
        fix = (
            "Pass what it needs in comm_state (its first argument), or register it with "
            "lightning_ddpx.hooks.register_hook_name(name, factory, options_type=...) and pass comm_hook=name."
        )
    elif len(takers) == 1:
        fix = f"Set comm_hook={takers[0]!r} or drop {argument}=..."
    elif takers:
        fix = f"Set comm_hook to one of {takers} or drop {argument}=..."
    else:
        fix = (
            f"Drop {argument}=..., or register a hook that takes them with "
            "lightning_ddpx.hooks.register_hook_name(name, factory, options_type=...)."
        )
    return f"DDPXStrategy: {what} are given but comm_hook is {hook}, which takes {takes}. {fix}"


def _argument_for(keyword: str) -> str:
    """The strategies' argument carrying options that build_comm_hook takes as ``keyword``."""
    return next(argument for argument, key in _OPTIONS_ARGUMENTS.items() if key == keyword)


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


# The names each registry gets: (name, description, arguments). Lightning's own DDP names with "ddp" spelled
# "ddpx" -- the same names and the same ``init_params`` as Lightning's ``DDPStrategy.register_strategies``,
# separately for the Trainer and for Fabric, whose registries differ -- plus our hook shortcuts.
_START_METHODS: tuple[tuple[str, str], ...] = (
    ("ddpx", "popen"),
    ("ddpx_spawn", "spawn"),
    ("ddpx_fork", "fork"),
    ("ddpx_notebook", "fork"),  # what Jupyter and Colab select: forks the notebook's process
)
_HOOK_SHORTCUTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("ddpx_fp16", "lightning_ddpx DDP with fp16-compressed allreduce", {"comm_hook": "fp16"}),
    ("ddpx_powersgd", "lightning_ddpx DDP with PowerSGD (default options)", {"comm_hook": "powersgd"}),
)


def _start_method_names() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (
            name,
            f"lightning_ddpx DDP with `start_method={method!r}` (like {name[:3] + name[4:]!r})",
            {"start_method": method},
        )
        for name, method in _START_METHODS
    ]


def _unused_parameters_name(name: str, method: str, find_unused: bool) -> tuple[str, str, dict[str, Any]]:
    return (
        f"{name}_find_unused_parameters_{str(find_unused).lower()}",
        f"lightning_ddpx DDP with `find_unused_parameters={find_unused}` and `start_method={method!r}`",
        {"find_unused_parameters": find_unused, "start_method": method},
    )


TRAINER_STRATEGY_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    *_start_method_names(),
    *(
        _unused_parameters_name(name, method, find_unused)
        for name, method in _START_METHODS
        for find_unused in (False, True)
    ),
    *_HOOK_SHORTCUTS,
)
FABRIC_STRATEGY_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    *_start_method_names(),
    _unused_parameters_name("ddpx", "popen", True),  # Fabric registers this one alone
    *_HOOK_SHORTCUTS,
)


def register_strategy_names(
    strategy_class: type, registry: Any, names: tuple[tuple[str, str, dict[str, Any]], ...]
) -> None:
    """Register ``names`` (:data:`TRAINER_STRATEGY_NAMES` or :data:`FABRIC_STRATEGY_NAMES`) for
    ``strategy_class`` in a Lightning or Fabric strategy registry."""
    for name, description, init_params in names:
        # override=True: re-importing (or reloading) lightning_ddpx must not fail on its own names
        registry.register(name, strategy_class, description=description, override=True, **init_params)
