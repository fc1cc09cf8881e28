"""True/False options must be booleans.

Python counts any non-empty string as true, so ``static_graph="False"`` (a YAML value quoted by mistake, a
value read from an environment variable) would silently mean ``True``; torch's DDP only tests truthiness.
One check for the module's options, torch's pass-through ones included, and the strategies'.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import numpy as np

__all__ = ["check_flags"]


def check_flags(owner: str, flags: Mapping[str, Any], optional: Collection[str] = ()) -> None:
    """Raise ``TypeError`` naming the first of ``flags`` (name -> value) that is not a boolean; those named
    in ``optional`` may also be ``None``."""
    for name, value in flags.items():
        if isinstance(value, (bool, np.bool_)) or (value is None and name in optional):
            continue
        allowed = "True, False or None" if name in optional else "True or False"
        raise TypeError(f"{owner}: {name} must be {allowed}, got {value!r} ({type(value).__name__}).")
