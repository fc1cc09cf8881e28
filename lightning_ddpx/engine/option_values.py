"""Checks on option values of the plain kinds, shared by the module, the strategies and the hooks.

True/False options must be booleans: Python counts any non-empty string as true, so ``static_graph="False"``
(a YAML value quoted by mistake, a value read from an environment variable) would silently mean ``True``;
torch's DDP only tests truthiness. Numbers must be finite, and ``math.isfinite`` alone would accept ``True``
and raise ``OverflowError`` (naming no option) on an integer too large for a float.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Collection, Mapping

import numpy as np

__all__ = ["check_flags", "is_finite_number"]


def check_flags(owner: str, flags: Mapping[str, Any], optional: Collection[str] = ()) -> None:
    """Raise ``TypeError`` naming the first of ``flags`` (name -> value) that is not a boolean; those named
    in ``optional`` may also be ``None``."""
    for name, value in flags.items():
        if isinstance(value, (bool, np.bool_)) or (value is None and name in optional):
            continue
        allowed = "True, False or None" if name in optional else "True or False"
        raise TypeError(f"{owner}: {name} must be {allowed}, got {value!r} ({type(value).__name__}).")


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is a real number, not a bool, that a float holds finitely."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False
