"""Our own background threads, stopped and joined before Python finalises.

Why: a daemon thread still inside a C++ call -- waiting on a collective's future, or writing to the
TCPStore, the GIL released -- when the interpreter finalises is killed as it re-takes the GIL, and the C++
runtime aborts the process ("terminate called without an active exception", exit code -6) instead of
letting it exit with its status. The communication thread (:mod:`~lightning_ddpx.engine.launcher`) and the
progress writer (:mod:`~lightning_ddpx.engine.diagnosis`) register here when their thread starts; one
``atexit`` handler stops them all, each waited for at most its own bound. The strategies' exit handler
(:mod:`lightning_ddpx.lightning.process_exit`) calls :func:`stop_all` first, before destroying the group.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol

__all__ = ["Stoppable", "stop_all", "stop_at_exit"]


class Stoppable(Protocol):
    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread; wait up to ``timeout`` s for it; return whether it has ended."""
        ...


# owner -> (thread name for messages, longest wait at exit); weak: a collected owner stopped its thread.
_RUNNING: "weakref.WeakKeyDictionary[Stoppable, tuple[str, float]]" = weakref.WeakKeyDictionary()
_handler_registered = False


def stop_at_exit(owner: Stoppable, name: str, timeout: float) -> None:
    """Stop ``owner``'s thread at interpreter exit (``owner.close(timeout)``), unless it was collected first."""
    global _handler_registered
    _RUNNING[owner] = (name, timeout)
    if not _handler_registered:
        atexit.register(stop_all)
        _handler_registered = True


def stop_all() -> list[str]:
    """Stop every registered thread, each waited for at most its bound; the names of those still running."""
    still_running = []
    for owner, (name, timeout) in list(_RUNNING.items()):
        if not owner.close(timeout):
            still_running.append(name)
    return still_running
