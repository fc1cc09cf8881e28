"""Hooks by name, for configuration files and the strategy: ``build_comm_hook("powersgd", ...)``.

A name maps to a factory ``factory(process_group, options) -> (state, hook)``; ``options`` is the
:class:`~lightning_ddpx.hooks.PowerSGDOptions` given to :func:`build_comm_hook` (``None`` if none was).
Users add names with :func:`register_hook_name`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch.distributed as dist

from lightning_ddpx.engine.backend_support import check_bf16_hook
from lightning_ddpx.hooks.default import (
    CommHook,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from lightning_ddpx.hooks.post_local_sgd import PostLocalSGDOptions, PostLocalSGDState, post_local_sgd_hook
from lightning_ddpx.hooks.powersgd import batched_powersgd_hook, powersgd_hook
from lightning_ddpx.hooks.powersgd.state import PowerSGDOptions, PowerSGDState

__all__ = ["HookFactory", "available_hooks", "build_comm_hook", "register_hook_name"]


class HookFactory(Protocol):
    """Builds ``(state, hook)`` for a registered name."""

    def __call__(self, process_group: dist.ProcessGroup | None, options: Any) -> tuple[Any, CommHook]: ...


def _stateless(hook: CommHook, name: str) -> HookFactory:
    def factory(
        process_group: dist.ProcessGroup | None, options: PowerSGDOptions | None
    ) -> tuple[Any, CommHook]:
        if options is not None:
            raise ValueError(
                f"hook {name!r} takes no PowerSGD options; drop `powersgd=` or choose 'powersgd' or "
                "'batched_powersgd'."
            )
        return process_group, hook

    return factory


def _powersgd(hook: CommHook) -> HookFactory:
    def factory(
        process_group: dist.ProcessGroup | None, options: PowerSGDOptions | None
    ) -> tuple[Any, CommHook]:
        if options is not None and not isinstance(options, PowerSGDOptions):
            raise TypeError(f"PowerSGD hooks take powersgd= options, got {type(options).__name__}")
        return PowerSGDState.from_options(options, process_group), hook

    return factory


def _post_local_sgd(process_group: dist.ProcessGroup | None, options: Any) -> tuple[Any, CommHook]:
    if options is not None and not isinstance(options, PostLocalSGDOptions):
        raise TypeError(f"hook 'post_local_sgd' takes post_local_sgd= options, got {type(options).__name__}")
    return PostLocalSGDState.from_options(options, process_group), post_local_sgd_hook


_BUILTIN: dict[str, HookFactory] = {
    "allreduce": _stateless(allreduce_hook, "allreduce"),
    "fp16": _stateless(fp16_compress_hook, "fp16"),
    "bf16": _stateless(bf16_compress_hook, "bf16"),
    "powersgd": _powersgd(powersgd_hook),
    "batched_powersgd": _powersgd(batched_powersgd_hook),
    "noop": _stateless(noop_hook, "noop"),
    "post_local_sgd": _post_local_sgd,
}
_REGISTRY: dict[str, HookFactory] = dict(_BUILTIN)
_WRAPPERS: dict[str, Callable[[CommHook], CommHook]] = {
    "fp16": fp16_compress_wrapper,
    "bf16": bf16_compress_wrapper,
}


def available_hooks() -> list[str]:
    """Every name :func:`build_comm_hook` accepts, sorted."""
    return sorted(_REGISTRY)


def build_comm_hook(
    name: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    powersgd: PowerSGDOptions | dict[str, Any] | None = None,
    wrapper: str | None = None,
    post_local_sgd: PostLocalSGDOptions | dict[str, Any] | None = None,
) -> tuple[Any, CommHook]:
    """``(state, hook)`` for ``model.register_comm_hook(state, hook)``.

    ``powersgd`` configures the PowerSGD names (a :class:`PowerSGDOptions` or a dict of its fields; torch's
    defaults if omitted). ``wrapper`` (``"fp16"`` or ``"bf16"``) casts the bucket before the hook and the
    result back, e.g. ``build_comm_hook("powersgd", wrapper="fp16")`` sends P and Q in half precision.
    Everything is validated here, before any communication, including (once a process group exists)
    that the backend can reduce bfloat16 when the hook or wrapper is ``"bf16"``.
    """
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"unknown communication hook {name!r}; valid names are {available_hooks()}")
    if wrapper is not None and wrapper not in _WRAPPERS:
        raise ValueError(f"unknown hook wrapper {wrapper!r}; valid wrappers are {sorted(_WRAPPERS)} or None")
    if isinstance(powersgd, dict):
        powersgd = PowerSGDOptions.from_dict(powersgd)
    elif powersgd is not None and not isinstance(powersgd, PowerSGDOptions):
        raise TypeError(
            f"powersgd must be a PowerSGDOptions, a dict of its fields or None, got {type(powersgd).__name__}"
        )
    if isinstance(post_local_sgd, dict):
        post_local_sgd = PostLocalSGDOptions.from_dict(post_local_sgd)
    elif post_local_sgd is not None and not isinstance(post_local_sgd, PostLocalSGDOptions):
        raise TypeError(
            "post_local_sgd must be a PostLocalSGDOptions, a dict of its fields or None, got "
            f"{type(post_local_sgd).__name__}"
        )
    if post_local_sgd is not None and name in _BUILTIN and name != "post_local_sgd":
        raise ValueError(
            f"hook {name!r} takes no post_local_sgd options; drop `post_local_sgd=` or choose 'post_local_sgd'."
        )
    state, hook = factory(process_group, powersgd if powersgd is not None else post_local_sgd)
    if wrapper is not None:
        hook = _WRAPPERS[wrapper](hook)
    if dist.is_available() and dist.is_initialized():
        # Known backends only (no probe: not every rank need build hooks at the same point); register_comm_hook
        # checks again, probing backends whose bfloat16 support is unknown.
        check_bf16_hook(hook, process_group)
    return state, hook


def register_hook_name(name: str, factory: HookFactory, *, replace: bool = False) -> None:
    """Make ``build_comm_hook(name, ...)`` return ``factory(process_group, options)``.

    Built-in names cannot be replaced; a name registered before can be with ``replace=True``.
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a hook name must be a non-empty string without surrounding spaces, got {name!r}")
    if not callable(factory):
        raise TypeError(
            f"factory for hook {name!r} must be callable as factory(process_group, options) -> (state, hook), "
            f"got {type(factory).__name__}"
        )
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in hook name and cannot be replaced; register another name")
    if name in _REGISTRY and not replace:
        raise ValueError(f"hook name {name!r} is already registered; pass replace=True to replace it")
    _REGISTRY[name] = factory
