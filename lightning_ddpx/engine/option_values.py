"""Checks on option values of the plain kinds, shared by the module, the strategies and the hooks.

True/False options must be booleans: Python counts any non-empty string as true, so ``static_graph="False"``
(a YAML value quoted by mistake, a value read from an environment variable) would silently mean ``True``;
torch's DDP only tests truthiness. Counts (steps, periods, ranks) must be integers, and a bool is not one:
``True`` passes ``isinstance(value, int)`` but counts nothing. Numbers must be finite, and ``math.isfinite``
alone would accept ``True`` and raise ``OverflowError`` (naming no option) on an integer too large for a float.

Each check raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for one out of range, with
one sentence: ``<owner>: <name> must be <what>, got <value>``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Collection, Mapping

import numpy as np

__all__ = ["check_flags", "check_int", "is_finite_number"]


def check_flags(owner: str, flags: Mapping[str, Any], optional: Collection[str] = ()) -> None:
    """Raise ``TypeError`` naming the first of ``flags`` (name -> value) that is not a boolean; those named
    in ``optional`` may also be ``None``."""
    for name, value in flags.items():
        if isinstance(value, (bool, np.bool_)) or (value is None and name in optional):
            continue
        allowed = "True, False or None" if name in optional else "True or False"
        raise TypeError(f"{owner}: {name} must be {allowed}, got {value!r} ({type(value).__name__}).")


def check_int(
    owner: str, name: str, value: Any, minimum: int | None = None, optional: bool = False, *, hint: str = ""
) -> None:
    """Raise naming ``owner``'s option ``name`` unless ``value`` is an integer of at least ``minimum``:
    ``TypeError`` if it is not an integer (``True``, ``2.0`` and ``"2"`` are not), ``ValueError`` if it is
    below ``minimum``. ``optional``: ``None`` passes too. ``hint`` ends both messages: what the option counts,
    how to choose it."""
    if value is None and optional:
        return
    wanted = "an integer" if minimum is None else f"an integer >= {minimum}"
    wanted += " or None" if optional else ""
    advice = f" {hint}" if hint else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be {wanted}, got {value!r} ({type(value).__name__}).{advice}")
    if minimum is not None and value < minimum:
        at_least = f">= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{owner}: {name} must be {at_least}, got {value!r}.{advice}")


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is a real number, not a bool, that a float holds finitely."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False
