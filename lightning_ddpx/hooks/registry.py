"""Hooks by name, for configuration files and the strategy: ``build_comm_hook("powersgd", ...)``.

A name maps to a :class:`HookEntry`: a factory ``factory(process_group, options) -> (state, hook)`` and the
type of the options it takes (``None``: it takes none), with the keyword that carries them. PowerSGD
(``powersgd=PowerSGDOptions``), post-local SGD (``post_local_sgd=PostLocalSGDOptions``), DiLoCo
(``diloco=DiLoCoOptions``) and a user's own
configurable hook (``options=...``) all register the same way; options given as a dict are parsed with the
type's ``from_dict`` (or its constructor), so a typo fails before any communication. Users add names with
:func:`register_hook_name`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

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
from lightning_ddpx.hooks.diloco import DiLoCoOptions, DiLoCoState, diloco_local_gradients_hook
from lightning_ddpx.hooks.post_local_sgd import PostLocalSGDOptions, PostLocalSGDState, post_local_sgd_hook
from lightning_ddpx.hooks.powersgd import batched_powersgd_hook, powersgd_hook
from lightning_ddpx.hooks.powersgd.state import PowerSGDOptions, PowerSGDState

__all__ = [
    "HookEntry",
    "HookFactory",
    "available_hooks",
    "build_comm_hook",
    "hook_entry",
    "hooks_taking",
    "register_hook_name",
]


class HookFactory(Protocol):
    """Builds ``(state, hook)`` for a registered name."""

    def __call__(self, process_group: dist.ProcessGroup | None, options: Any) -> tuple[Any, CommHook]: ...


@dataclass(frozen=True)
class HookEntry:
    """A registered hook name: how to build it and which options it takes.

    ``options_type``: the options class (``None``: the hook takes none); ``keyword``: the argument of
    :func:`build_comm_hook` (and of the strategies, for the built-in ones) that carries them.
    """

    factory: HookFactory
    options_type: type | None = None
    keyword: str = "options"

    def parse(self, name: str, options: Any) -> Any:
        """``options`` as an instance of ``options_type`` (a dict is parsed); ``None`` stays ``None``."""
        if options is None or self.options_type is None:
            return options
        if isinstance(options, self.options_type):
            return options
        if isinstance(options, Mapping):
            from_dict = getattr(self.options_type, "from_dict", None)
            if from_dict is not None:
                return from_dict(dict(options))
            if dataclasses.is_dataclass(self.options_type):
                known = [f.name for f in dataclasses.fields(self.options_type)]
                unknown = sorted(set(options) - set(known))
                if unknown:
                    raise TypeError(
                        f"unknown {self.keyword} option(s) {unknown} for hook {name!r}; its options are {known}"
                    )
            return self.options_type(**options)
        raise TypeError(
            f"{self.keyword} must be a {self.options_type.__name__} or a dict of its fields, got "
            f"{type(options).__name__}"
        )


def _stateless(hook: CommHook) -> HookEntry:
    return HookEntry(lambda process_group, options: (process_group, hook))


def _powersgd(hook: CommHook) -> HookEntry:
    return HookEntry(
        lambda process_group, options: (PowerSGDState.from_options(options, process_group), hook),
        PowerSGDOptions,
        "powersgd",
    )


_BUILTIN: dict[str, HookEntry] = {
    "allreduce": _stateless(allreduce_hook),
    "fp16": _stateless(fp16_compress_hook),
    "bf16": _stateless(bf16_compress_hook),
    "powersgd": _powersgd(powersgd_hook),
    "batched_powersgd": _powersgd(batched_powersgd_hook),
    "noop": _stateless(noop_hook),
    "post_local_sgd": HookEntry(
        lambda process_group, options: (
            PostLocalSGDState.from_options(options, process_group),
            post_local_sgd_hook,
        ),
        PostLocalSGDOptions,
        "post_local_sgd",
    ),
    "diloco": HookEntry(
        lambda process_group, options: (DiLoCoState(options, process_group), diloco_local_gradients_hook),
        DiLoCoOptions,
        "diloco",
    ),
}
_REGISTRY: dict[str, HookEntry] = dict(_BUILTIN)
_WRAPPERS: dict[str, Callable[[CommHook], CommHook]] = {
    "fp16": fp16_compress_wrapper,
    "bf16": bf16_compress_wrapper,
}


def hook_entry(name: str) -> HookEntry | None:
    """The entry registered as ``name``, or ``None``."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def _who_takes(keyword: str) -> str:
    takers = " or ".join(repr(n) for n in hooks_taking(keyword))
    return f"drop `{keyword}=` or choose {takers}." if takers else f"drop `{keyword}=`."


def hooks_taking(keyword: str) -> list[str]:
    """The registered names whose options come in the ``keyword`` argument (e.g. ``"powersgd"``), sorted."""
    return sorted(
        name for name, entry in _REGISTRY.items() if entry.options_type and entry.keyword == keyword
    )


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
    diloco: DiLoCoOptions | dict[str, Any] | None = None,
    options: Any = None,
) -> tuple[Any, CommHook]:
    """``(state, hook)`` for ``model.register_comm_hook(state, hook)``.

    ``powersgd`` configures the PowerSGD names (a :class:`PowerSGDOptions` or a dict of its fields; torch's
    defaults if omitted), ``post_local_sgd`` the post-local SGD hook, ``diloco`` DiLoCo (:mod:`lightning_ddpx.hooks.diloco`), ``options`` a hook registered with an
    ``options_type`` of its own; options for a hook that takes none are an error naming the hooks that do. ``wrapper`` (``"fp16"`` or ``"bf16"``) casts the bucket before the hook and the
    result back, e.g. ``build_comm_hook("powersgd", wrapper="fp16")`` sends P and Q in half precision.
    Everything is validated here, before any communication, including (once a process group exists)
    that the backend can reduce bfloat16 when the hook or wrapper is ``"bf16"``.
    """
    entry = hook_entry(name)
    if entry is None:
        raise ValueError(f"unknown communication hook {name!r}; valid names are {available_hooks()}")
    if wrapper is not None and wrapper not in _WRAPPERS:
        raise ValueError(f"unknown hook wrapper {wrapper!r}; valid wrappers are {sorted(_WRAPPERS)} or None")
    keywords = {"options": options, "powersgd": powersgd, "post_local_sgd": post_local_sgd, "diloco": diloco}
    given = {keyword: value for keyword, value in keywords.items() if value is not None}
    for keyword in given:
        if entry.options_type is None or keyword != entry.keyword:
            raise ValueError(f"hook {name!r} takes no {keyword} options; {_who_takes(keyword)}")
    state, hook = entry.factory(process_group, entry.parse(name, given.get(entry.keyword)))
    if wrapper is not None:
        hook = _WRAPPERS[wrapper](hook)
    if dist.is_available() and dist.is_initialized():
        # Known backends only (no probe: not every rank need build hooks at the same point); register_comm_hook
        # checks again, probing backends whose bfloat16 support is unknown.
        check_bf16_hook(hook, process_group)
    return state, hook


def register_hook_name(
    name: str, factory: HookFactory, *, options_type: type | None = None, replace: bool = False
) -> None:
    """Make ``build_comm_hook(name, options=...)`` return ``factory(process_group, options)``.

    With ``options_type`` (a dataclass, say), ``options`` given as a dict is parsed into it (its
    ``from_dict`` if it has one, else its constructor) and anything else is refused, before the factory
    runs -- as PowerSGD's options are. Built-in names cannot be replaced; a name registered before can be
    with ``replace=True``.
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a hook name must be a non-empty string without surrounding spaces, got {name!r}")
    if not callable(factory):
        raise TypeError(
            f"factory for hook {name!r} must be callable as factory(process_group, options) -> (state, hook), "
            f"got {type(factory).__name__}"
        )
    if options_type is not None and not isinstance(options_type, type):
        raise TypeError(f"options_type for hook {name!r} must be a class, got {options_type!r}")
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in hook name and cannot be replaced; register another name")
    if name in _REGISTRY and not replace:
        raise ValueError(f"hook name {name!r} is already registered; pass replace=True to replace it")
    _REGISTRY[name] = HookEntry(factory, options_type)
