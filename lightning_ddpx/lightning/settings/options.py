"""Every option the two ``DDPXStrategy`` classes take beyond Lightning's own arguments, each declared once.

Where the declarations are:

- our options (hook, module, Lightning behaviour) are the fields of
  :class:`~lightning_ddpx.lightning.settings.config.DDPXConfig`: name, type, default, its own check and its doc text
  (``_option(...)``), and which strategies take it;
- Lightning's and torch's other spellings of them (``ddp_comm_hook``, ``forward_sync_buffers``, ...), which
  :func:`~lightning_ddpx.lightning.settings.ddp_kwargs.build_ddpx_config` maps onto ours, are :data:`SPELLINGS` below.

What follows from them, so nothing is written twice:

- each strategy's signature (``__init__.__signature__``: what LightningCLI, ``help()`` and
  ``inspect.signature`` read) and the ``Args`` of its docstring: :func:`takes_ddpx_options`;
- the read-only attributes ``strategy.bucket_cap_mb``, ... (:class:`~lightning_ddpx.lightning.settings.config.DDPXConfigAttributes`);
- the option tables in docs/strategy.md and docs/fabric.md: :func:`options_table`
  (``python scripts/options_tables.py`` rewrites them; tests/lightning/test_options.py fails when they are stale).

Adding an option: one ``_option(...)`` field on ``DDPXConfig`` (or an :class:`Option` in :data:`SPELLINGS`),
then use it where it acts; docs/dev/architecture.md has the recipe.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

from lightning_ddpx.engine.buckets.grad_bucket import CommHook
from lightning_ddpx.lightning.settings.config import DDPXConfig

__all__ = [
    "SPELLINGS",
    "STRATEGIES",
    "Option",
    "option_names",
    "options_for",
    "options_table",
    "takes_ddpx_options",
]

STRATEGIES = ("Trainer", "Fabric")


@dataclass(frozen=True)
class Option:
    """One keyword argument of the strategies, as the signatures, docstrings and docs tables show it."""

    name: str
    annotation: Any
    default: Any
    doc: str
    strategies: tuple[str, ...] = STRATEGIES
    fabric_doc: Optional[str] = None

    def doc_for(self, strategy: str) -> str:
        return self.fabric_doc if strategy == "Fabric" and self.fabric_doc else self.doc


# Lightning's DDPStrategy names and torch DDP arguments that are not fields of DDPXConfig: mapped onto ours
# (or accepted as what they are) by ddp_kwargs.build_ddpx_config; docs/strategy.md tables the rest of torch's.
SPELLINGS: tuple[Option, ...] = (
    Option("ddp_comm_state", Optional[Any], None, "Lightning's name for ``comm_state``."),
    Option("ddp_comm_hook", Optional[Union[str, CommHook]], None, "Lightning's name for ``comm_hook``."),
    Option(
        "ddp_comm_wrapper",
        Optional[Union[str, Callable[[CommHook], CommHook]]],
        None,
        "Lightning's wrapper argument: torch's ``fp16_compress_wrapper``/``bf16_compress_wrapper`` (or their "
        "import paths) become ``comm_wrapper``; any other wrapper is applied to the callable hook.",
    ),
    Option(
        "forward_sync_buffers",
        Optional[bool],
        None,
        "torch's newer name for the per-forward buffer sync (``None``: take ``broadcast_buffers``).",
    ),
    Option(
        "skip_all_reduce_unused_params",
        bool,
        False,
        "torch's; accepted: parameters unused on every rank keep their gradient either way.",
    ),
    Option(
        "batched_grad_copy",
        bool,
        False,
        "torch's; accepted: each bucket is always copied in one batched call.",
    ),
)


@functools.cache  # the declarations are fixed once DDPXConfig is defined; every strategy built reads them
def _config_options() -> tuple[Option, ...]:
    hints = typing.get_type_hints(DDPXConfig, globalns=vars(sys.modules[DDPXConfig.__module__]))
    return tuple(
        Option(
            f.name,
            hints[f.name],
            f.default,
            f.metadata["doc"],
            f.metadata["strategies"],
            f.metadata["fabric_doc"],
        )
        for f in dataclasses.fields(DDPXConfig)
    )


def options_for(strategy: str) -> tuple[Option, ...]:
    """The options ``strategy`` (``"Trainer"`` or ``"Fabric"``) takes, in signature order."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    return tuple(o for o in (*_config_options(), *SPELLINGS) if strategy in o.strategies)


def option_names(strategy: Optional[str] = None) -> frozenset[str]:
    """Names of the options of ``strategy``, or of either strategy when ``None``."""
    strategies = STRATEGIES if strategy is None else (strategy,)
    return frozenset(o.name for s in strategies for o in options_for(s))


_Class = TypeVar("_Class", bound=type)


def takes_ddpx_options(strategy: str) -> Callable[[_Class], _Class]:
    """Class decorator: the strategy's ``__init__(self, <Lightning's arguments>, **kwargs)`` gets the signature
    Lightning's arguments + our options (keyword-only, typed, with defaults) + ``**kwargs`` (torch's DDP
    arguments, checked by name), and the class docstring gets an ``Args`` entry per option."""

    def decorate(cls: _Class) -> _Class:
        init = cls.__init__
        own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
        ours = [
            inspect.Parameter(
                o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation
            )
            for o in options_for(strategy)
        ]
        torch_kwargs = inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any)
        init.__signature__ = inspect.Signature([*own, *ours, torch_kwargs])
        init.__annotations__ = {
            **typing.get_type_hints(init, globalns=vars(sys.modules[cls.__module__])),
            **{o.name: o.annotation for o in options_for(strategy)},
        }
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n" + _args_section(strategy) + "\n"
        return cls

    return decorate


def _args_section(strategy: str) -> str:
    lines = ["    Args:"]
    for option in options_for(strategy):
        text = f"{option.name}: {option.doc_for(strategy)}"
        lines.extend(textwrap.wrap(text, 108, initial_indent=" " * 8, subsequent_indent=" " * 12))
    return "\n".join(lines)


def options_table(strategy: str) -> str:
    """The Markdown table of ``strategy``'s own options (not Lightning's other spellings) for the docs."""
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    spelled = {o.name for o in SPELLINGS}
    for option in options_for(strategy):
        if option.name in spelled:
            continue
        meaning = option.doc_for(strategy).replace("``", "`").replace("|", "\\|")
        rows.append(f"| `{option.name}` | `{option.default!r}` | {meaning} |")
    return "\n".join(rows)
