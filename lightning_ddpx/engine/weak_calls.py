"""Calls that do not keep their object alive.

A callback the reducer hands to a longer-lived holder (an autograd node's pre-hook, which outlives the
iteration with the graph; the module's settings check, which the reducer holds) must not keep that object,
its reducer and its threads alive, nor close a reference cycle that only the garbage collector can break.
"""

from __future__ import annotations

import weakref
from typing import Callable

__all__ = ["weakly"]


def weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method()`` (a bound method) while its object lives; nothing after."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call
