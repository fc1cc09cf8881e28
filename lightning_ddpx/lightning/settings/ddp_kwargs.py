"""Lightning's ``DDPStrategy`` argument names and torch's DDP keyword arguments, mapped onto ours.

A project switching from ``strategy=DDPStrategy(...)`` to ``DDPXStrategy(...)`` keeps its arguments:

- ``ddp_comm_hook`` / ``ddp_comm_state`` / ``ddp_comm_wrapper`` (Lightning's names) become ``comm_hook`` /
  ``comm_state`` / ``comm_wrapper``; torch's ``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` become our
  ``"fp16"`` / ``"bf16"`` wrappers (which work with named hooks too), any other wrapper is applied to the
  callable hook as Lightning does. Giving both spellings of one option is an error, not a silent choice.
- torch's DDP keyword arguments, which Lightning forwards to ``torch.nn.parallel.DistributedDataParallel``
  through ``**kwargs``: each one is either honoured with torch's meaning or refused here, naming it and
  what to do instead (:data:`REFUSED`). None is dropped silently. docs/strategy.md has the table.

Pure functions, no process group: everything is checked in the strategies' constructors, before launch.
"""

from __future__ import annotations

import difflib
import importlib
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from lightning_ddpx.engine.module.unsupported_options import UNSUPPORTED_TORCH_ARGUMENTS
from lightning_ddpx.engine.option_values import check_flags
from lightning_ddpx.hooks.registry import wrapper_named, wrapper_names

if TYPE_CHECKING:
    from lightning_ddpx.lightning.settings.config import DDPXConfig

__all__ = [
    "HONOURED",
    "REFUSED",
    "build_ddpx_config",
    "check_passthrough_kwargs",
    "merge_lightning_hook_args",
    "torch_ddp_kwargs",
    "wrapper_name",
]

# torch DDP keyword arguments the strategies take as named, typed arguments (so LightningCLI sees them),
# with torch's meaning. Documented one by one in docs/strategy.md.
HONOURED = (
    "broadcast_buffers",
    "bucket_cap_mb",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "init_sync",
    "forward_sync_buffers",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
)

# torch DDP keyword arguments we refuse unless left at torch's default: (default, why, what to do instead).
REFUSED: dict[str, tuple[Any, str]] = {
    "device_ids": (
        None,
        "the strategy puts each process's model on its own device (Trainer/Fabric devices=...), as "
        "Lightning's DDPStrategy does when it passes device_ids itself. Remove device_ids.",
    ),
    "output_device": (
        None,
        "outputs stay on the device the module computes on, as with torch's single-device DDP. Remove "
        "output_device (move outputs in your LightningModule if needed).",
    ),
    "dim": (
        0,
        "dim only matters when torch scatters inputs over several devices of one process, which neither "
        "torch's single-device DDP nor lightning_ddpx does. Remove dim.",
    ),
    "process_group": (
        None,
        "the strategy averages over the world group it creates. To communicate over a subgroup, pass a "
        "callable comm_hook with comm_state=<your group>, or wrap the module yourself in "
        "lightning_ddpx.DistributedDataParallel(module, process_group=...).",
    ),
    "device_mesh": (
        None,
        "lightning_ddpx replicates over one process group, not a device mesh. Remove device_mesh; the "
        "strategy uses the world group.",
    ),
    # torch's arguments for features the engine does not implement: the engine's own reasons
    **{
        name: (None, why)
        for name, why in UNSUPPORTED_TORCH_ARGUMENTS.items()
        if name != "device_mesh"  # the engine says to pass process_group=, which the strategies refuse
    },
}

_DEPRECATED_NO_OP = {
    "check_reduction": "torch deprecated check_reduction and ignores it (the reducer always completes "
    "the reduction); lightning_ddpx ignores it too. Remove it.",
}


def check_passthrough_kwargs(kwargs: Mapping[str, Any], owner: str) -> None:
    """Validate the torch DDP keyword arguments that are not named arguments of ``owner``.

    Each is accepted only where it changes nothing (torch's default, or a deprecated no-op with torch's
    warning); otherwise refused with a ``ValueError`` naming it and the fix. An unknown name is a
    ``TypeError``, with the closest known name suggested.
    """
    for name, value in kwargs.items():
        if name in REFUSED:
            default, why = REFUSED[name]
            if value is default or (default is not None and value == default):
                continue
            raise ValueError(f"{owner}: torch DDP argument {name}={_short(value)} is not supported: {why}")
        if name in _DEPRECATED_NO_OP:
            check_flags(owner, {name: value})
            if value:
                warnings.warn(
                    f"{owner}: {name}=True has no effect: {_DEPRECATED_NO_OP[name]}",
                    FutureWarning,
                    stacklevel=3,
                )
            continue
        known = [
            *HONOURED,
            *REFUSED,
            *_DEPRECATED_NO_OP,
            "ddp_comm_hook",
            "ddp_comm_state",
            "ddp_comm_wrapper",
        ]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"{owner} got an unexpected keyword argument {name!r}.{hint} It takes Lightning's DDPStrategy "
            "arguments and torch's DistributedDataParallel keyword arguments (see docs/strategy.md)."
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 and "\n" not in text else f"<{type(value).__name__}>"


def resolve_forward_sync_buffers(
    broadcast_buffers: bool, forward_sync_buffers: Optional[bool], owner: str
) -> bool:
    """torch 2.13's ``forward_sync_buffers`` is the new name of ``broadcast_buffers``'s per-forward sync."""
    if forward_sync_buffers is None:
        return broadcast_buffers
    if not broadcast_buffers and forward_sync_buffers:
        raise ValueError(
            f"{owner}: broadcast_buffers=False and forward_sync_buffers=True contradict each other. "
            "forward_sync_buffers replaces the deprecated broadcast_buffers: pass only forward_sync_buffers."
        )
    return forward_sync_buffers


def wrapper_name(wrapper: Any) -> Optional[str]:
    """The registry's name (``"fp16"``, ``"bf16"``) of torch's or our compression wrappers (or of those names,
    or their import paths), else ``None``."""
    if isinstance(wrapper, str):
        if wrapper in wrapper_names() or "." not in wrapper:
            return wrapper  # a name (an unknown one is refused by DDPXConfig, listing the valid ones)
        wrapper = _import(wrapper, "ddp_comm_wrapper")
    return wrapper_named(wrapper)


def merge_lightning_hook_args(
    comm_hook: Any,
    comm_state: Any,
    comm_wrapper: Any,
    ddp_comm_hook: Any,
    ddp_comm_state: Any,
    ddp_comm_wrapper: Optional[Callable[[Any], Any]],
    owner: str,
) -> tuple[Any, Any, Any]:
    """``(comm_hook, comm_state, comm_wrapper)`` from both spellings; both of one option is an error.

    A torch hook callable is used as is. A wrapper other than torch's fp16/bf16 ones is applied to the
    hook here, as Lightning does (``ddp_comm_wrapper(ddp_comm_hook)``); it needs a callable hook.
    """
    for ours, theirs, our_name, their_name in (
        (comm_hook, ddp_comm_hook, "comm_hook", "ddp_comm_hook"),
        (comm_state, ddp_comm_state, "comm_state", "ddp_comm_state"),
        (comm_wrapper, ddp_comm_wrapper, "comm_wrapper", "ddp_comm_wrapper"),
    ):
        if ours is not None and theirs is not None:
            raise ValueError(
                f"{owner}: both {our_name} and {their_name} are given. They are two spellings of one option "
                f"({their_name} is Lightning DDPStrategy's name); pass only one."
            )
    hook = comm_hook if comm_hook is not None else ddp_comm_hook
    state = comm_state if comm_state is not None else ddp_comm_state
    if ddp_comm_wrapper is None:
        return hook, state, comm_wrapper
    name = wrapper_name(ddp_comm_wrapper)
    if name is not None:
        return hook, state, name
    if not callable(ddp_comm_wrapper):
        raise TypeError(
            f"{owner}: ddp_comm_wrapper must be a hook wrapper (e.g. torch's fp16_compress_wrapper), "
            f"got {type(ddp_comm_wrapper).__name__}."
        )
    if isinstance(hook, str):
        from lightning_ddpx.lightning.settings.config import resolve_comm_hook

        hook = resolve_comm_hook(hook)  # an import path becomes the callable; a registered name stays
    if hook is None or isinstance(hook, str):
        raise ValueError(
            f"{owner}: ddp_comm_wrapper={getattr(ddp_comm_wrapper, '__qualname__', ddp_comm_wrapper)!r} wraps a "
            f"callable hook, but the hook is {hook!r}. Pass the hook callable as ddp_comm_hook, or use "
            "comm_wrapper='fp16'/'bf16' with a named hook."
        )
    return ddp_comm_wrapper(hook), state, None


def _import(path: str, option: str) -> Any:
    module_name, _, attribute = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"{option}={path!r} is neither {' nor '.join(map(repr, wrapper_names()))} nor an importable "
            f"wrapper: {error}"
        ) from None


def build_ddpx_config(owner: str, strategy: str, arguments: Mapping[str, Any]) -> "DDPXConfig":
    """The :class:`~lightning_ddpx.lightning.settings.config.DDPXConfig` of a ``strategy`` (``"Trainer"``/``"Fabric"``)
    from every keyword argument beyond Lightning's own that its constructor received.

    Our options (:mod:`lightning_ddpx.lightning.settings.options`) are taken by name, Lightning's and torch's
    spellings are mapped, and what is left is a torch DDP argument: honoured, refused or unknown here.
    """
    from lightning_ddpx.lightning.settings.options import option_names

    accepted = option_names(strategy)
    elsewhere = sorted(set(arguments) & (option_names() - accepted))
    if elsewhere:
        raise TypeError(
            f"{owner}: {elsewhere[0]} is an option of the other DDPX strategy only (see its docs). "
            "Fabric has no step loop to log from: read fabric.strategy's statistics with "
            "lightning_ddpx.fabric.take_comm_stats(model) instead."
        )
    ours = {name: value for name, value in arguments.items() if name in accepted}
    passthrough = {name: value for name, value in arguments.items() if name not in accepted}
    return _config_from(owner, passthrough, **ours)


def torch_ddp_kwargs(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The torch DDP keyword arguments among ``arguments`` (honoured or refused ones), as given: what
    Lightning's ``DDPStrategy`` keeps in ``strategy._ddp_kwargs``, for code that reads them there (e.g.
    ``find_unused_parameters`` of a registered name such as ``ddpx_find_unused_parameters_true``)."""
    return {name: value for name, value in arguments.items() if name in HONOURED or name in REFUSED}


def _config_from(
    owner: str,
    passthrough: Mapping[str, Any],
    *,
    ddp_comm_hook: Any = None,
    ddp_comm_state: Any = None,
    ddp_comm_wrapper: Any = None,
    forward_sync_buffers: Optional[bool] = None,
    skip_all_reduce_unused_params: bool = False,
    batched_grad_copy: bool = False,
    **options: Any,
) -> "DDPXConfig":
    """``options`` are DDPXConfig's own fields; the rest are Lightning's and torch's spellings, mapped here.
    ``skip_all_reduce_unused_params`` and ``batched_grad_copy`` are accepted as what they are in torch,
    optimisations that leave every gradient unchanged: our reducer already copies each bucket in one batched
    call, and parameters unused on every rank keep their gradient untouched either way.
    """
    from lightning_ddpx.lightning.settings.config import DDPXConfig

    check_passthrough_kwargs(passthrough, owner)
    broadcast_buffers = options.get("broadcast_buffers", True)  # merged with forward_sync_buffers below
    flags = {
        "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
        "batched_grad_copy": batched_grad_copy,
        "forward_sync_buffers": forward_sync_buffers,
        "broadcast_buffers": broadcast_buffers,
    }
    check_flags(owner, flags, optional=("forward_sync_buffers", "broadcast_buffers"))
    if broadcast_buffers is None:  # torch 2.13's default: True unless forward_sync_buffers says otherwise
        options["broadcast_buffers"] = True
    hook, state, wrapper = merge_lightning_hook_args(
        options.pop("comm_hook", None),
        options.pop("comm_state", None),
        options.pop("comm_wrapper", None),
        ddp_comm_hook,
        ddp_comm_state,
        ddp_comm_wrapper,
        owner,
    )
    options["broadcast_buffers"] = resolve_forward_sync_buffers(
        options.get("broadcast_buffers", True), forward_sync_buffers, owner
    )
    return DDPXConfig(comm_hook=hook, comm_state=state, comm_wrapper=wrapper, **options)
