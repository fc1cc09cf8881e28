"""Hooks by name, for configuration files and the strategy: ``build_comm_hook("powersgd", ...)``.

The one table of hooks and wrappers; the strategies, their docs and the bench ask it instead of keeping
their own. A name maps to a :class:`HookEntry`: a factory ``factory(process_group, options) -> (state,
hook)`` and the type of the options it takes (``None``: it takes none), with the keyword that carries them.
PowerSGD (``powersgd=PowerSGDOptions``, both PowerSGD names), post-local SGD
(``post_local_sgd=PostLocalSGDOptions``), DiLoCo (``diloco=DiLoCoOptions``) and a user's own configurable
hook (``options=...``; the strategies' ``comm_hook_options=...``) all register the same way; options given
as a dict are parsed with the type's ``from_dict`` (or its constructor, after checking the plain fields'
types), so a typo fails before any communication. Users add names with :func:`register_hook_name`.

A wrapper name (``"fp16"``, ``"bf16"``) maps to ours and to torch's function of the same meaning, which
Lightning users pass as ``ddp_comm_wrapper``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch.distributed as dist

from lightning_ddpx.engine.buckets.grad_bucket import CommHook
from lightning_ddpx.engine.option_values import check_flags, check_int, is_finite_number
from lightning_ddpx.engine.transport.backend_support import check_bf16_hook
from lightning_ddpx.hooks.default import (
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
    "HookWrapper",
    "available_hooks",
    "build_comm_hook",
    "builtin_hooks",
    "hook_entry",
    "hooks_taking",
    "register_hook_name",
    "wrap_hook",
    "wrapper_named",
    "wrapper_names",
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

    def takes(self, keyword: str) -> bool:
        """Whether options given in ``keyword`` are this hook's (the one rule: no options type, no options)."""
        return self.options_type is not None and keyword == self.keyword

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
                _check_plain_fields(self.options_type, options)
            return self.options_type(**options)
        raise TypeError(
            f"{self.keyword} must be a {self.options_type.__name__} or a dict of its fields, got "
            f"{type(options).__name__}"
        )


def _check_plain_fields(options_type: type, values: Mapping[str, Any]) -> None:
    """Check each value of ``values`` whose dataclass field is declared ``bool``, ``int``, ``float`` or ``str``
    (or ``Optional`` of one), naming ``options_type`` and the field: a type without ``from_dict`` has no
    checks of its own, and a YAML value quoted by mistake (``"0.5"``, ``"false"``) would pass into the hook."""
    try:
        hints = typing.get_type_hints(options_type)
    except (NameError, TypeError):  # an annotation that cannot be resolved here: the type checks itself
        return
    owner = options_type.__name__
    for name, value in values.items():
        kind, optional = _plain_kind(hints.get(name))
        if kind is None or (value is None and optional):
            continue
        if kind is bool:
            check_flags(owner, {name: value})
        elif kind is int:
            check_int(owner, name, value)
        elif kind is float and not is_finite_number(value):
            raise TypeError(
                f"{owner}: {name} must be a finite number, got {value!r} ({type(value).__name__})."
            )
        elif kind is str and not isinstance(value, str):
            raise TypeError(f"{owner}: {name} must be a string, got {value!r} ({type(value).__name__}).")


def _plain_kind(hint: Any) -> tuple[type | None, bool]:
    """``(kind, optional)`` of a field's type hint when it is a plain kind (or ``Optional`` of one)."""
    arguments = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in arguments
    if optional:
        rest = [a for a in arguments if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
    return (hint if hint in (bool, int, float, str) else None), optional


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


@dataclass(frozen=True)
class HookWrapper:
    """A casting wrapper by name: ours, and the name of torch's function of the same meaning in
    ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks`` (Lightning's ``ddp_comm_wrapper``)."""

    wrap: Callable[[CommHook], CommHook]
    torch_name: str


_WRAPPERS: dict[str, HookWrapper] = {
    "fp16": HookWrapper(fp16_compress_wrapper, "fp16_compress_wrapper"),
    "bf16": HookWrapper(bf16_compress_wrapper, "bf16_compress_wrapper"),
}


def hook_entry(name: str) -> HookEntry | None:
    """The entry registered as ``name``, or ``None``."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def builtin_hooks() -> list[str]:
    """The built-in names, in the order the docs list them."""
    return list(_BUILTIN)


def wrapper_names() -> list[str]:
    """The wrappers ``wrapper=`` (and the strategies' ``comm_wrapper=``) accept, sorted."""
    return sorted(_WRAPPERS)


def wrap_hook(hook: CommHook, wrapper: str) -> CommHook:
    """``hook`` cast by the wrapper named ``wrapper`` (``"fp16"``: ``fp16_compress_wrapper(hook)``)."""
    return _wrapper(wrapper).wrap(hook)


def _wrapper(name: Any) -> HookWrapper:
    if not isinstance(name, str) or name not in _WRAPPERS:
        raise ValueError(f"unknown hook wrapper {name!r}; valid wrappers are {wrapper_names()} or None")
    return _WRAPPERS[name]


def wrapper_named(wrapper: Any) -> str | None:
    """The name (``"fp16"``, ``"bf16"``) of a wrapper function, ours or torch's; ``None`` for any other."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for name, known in _WRAPPERS.items():
        if wrapper is known.wrap or wrapper is getattr(default_hooks, known.torch_name, None):
            return name
    return None


def _who_takes(keyword: str) -> str:
    takers = " or ".join(repr(n) for n in hooks_taking(keyword))
    return f"drop `{keyword}=` or choose {takers}." if takers else f"drop `{keyword}=`."


def hooks_taking(keyword: str) -> list[str]:
    """The registered names whose options come in the ``keyword`` argument (e.g. ``"powersgd"``), sorted."""
    return sorted(name for name, entry in _REGISTRY.items() if entry.takes(keyword))


def available_hooks() -> list[str]:
    """Every name :func:`build_comm_hook` accepts, sorted.

    Example::

        >>> from lightning_ddpx.hooks import available_hooks
        >>> "powersgd" in available_hooks()
        True
    """
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

    Example::

        >>> from lightning_ddpx.hooks import build_comm_hook
        >>> state, hook = build_comm_hook("powersgd", powersgd={"matrix_approximation_rank": 2})
        >>> state.options.matrix_approximation_rank
        2
        >>> model.register_comm_hook(state, hook)  # doctest: +SKIP
        >>> state, hook = build_comm_hook("fp16")  # stateless: state is None
        >>> state is None
        True
    """
    entry = hook_entry(name)
    if entry is None:
        raise ValueError(f"unknown communication hook {name!r}; valid names are {available_hooks()}")
    if wrapper is not None:
        _wrapper(wrapper)  # an unknown one fails before the options are parsed
    keywords = {"options": options, "powersgd": powersgd, "post_local_sgd": post_local_sgd, "diloco": diloco}
    given = {keyword: value for keyword, value in keywords.items() if value is not None}
    for keyword in given:
        if not entry.takes(keyword):
            raise ValueError(f"hook {name!r} takes no {keyword} options; {_who_takes(keyword)}")
    state, hook = entry.factory(process_group, entry.parse(name, given.get(entry.keyword)))
    if wrapper is not None:
        hook = wrap_hook(hook, wrapper)
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
    ``from_dict`` if it has one, else its constructor, after checking the values of its ``bool``, ``int``,
    ``float`` and ``str`` fields) and anything else is refused, before the factory runs -- as PowerSGD's
    options are. The strategies pass ``comm_hook_options=...`` here (from Python, YAML or the command
    line). Without ``options_type`` the hook takes no options. Built-in names cannot be replaced; a name
    registered before can be with ``replace=True``.
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
