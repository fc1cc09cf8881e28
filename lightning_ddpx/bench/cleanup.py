"""Nothing left behind: what a benchmark creates outside its process goes when it ends, however it ends.

A benchmark creates things that outlive its process unless it removes them: network namespaces
(:mod:`lightning_ddpx.bench.netns`), temporary directories of logs and checkpoints, child processes. Python
removes them in ``finally`` blocks, ``with`` blocks and ``atexit`` handlers -- on a normal exit and on
Ctrl-C (``SIGINT`` raises ``KeyboardInterrupt``), but not on ``SIGTERM`` or ``SIGHUP``, whose default action
ends the process at once. ``SIGTERM`` is how ``timeout``, a CI runner or a job scheduler stops a job. Two
pieces close that gap:

- :func:`exits_through_python` (a decorator for a benchmark's ``main``, or a ``with`` block): while it holds,
  ``SIGTERM`` and ``SIGHUP`` raise ``SystemExit(128 + signal)``, so the same clean-up code runs as on
  Ctrl-C, and the exit status is the one the shell reports for a signal. A second signal while the first
  one unwinds is ignored, so a clean-up is not cut short by an impatient sender's repeat.
- Names that carry the creating process's id (``<prefix>-<pid>-...``), so that the next run removes what a
  process killed with ``SIGKILL`` -- which no handler sees -- left: :func:`temporary_directory` removes the
  directories of dead processes before it makes its own, as ``VethLink`` does with namespaces. Things of
  live processes are never touched, so parallel runs do not remove each other's.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "EXIT_SIGNALS",
    "exits_through_python",
    "hold_exit_handlers",
    "owned_name",
    "pid_alive",
    "release_exit_handlers",
    "remove_stale_directories",
    "temporary_directory",
]

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # SIGINT needs nothing: Python raises KeyboardInterrupt

_holders = 0  # nested exits_through_python blocks; the handlers go back when the last one ends
_previous: dict[int, Any] = {}
_exiting = False


def _raise_system_exit(signum: int, frame: object) -> None:
    global _exiting
    if _exiting:  # already unwinding for an earlier signal: let its clean-up finish
        return
    _exiting = True
    raise SystemExit(128 + signum)


def _hold() -> bool:
    global _holders, _exiting
    if threading.current_thread() is not threading.main_thread():
        return False  # Python sets handlers on the main thread only; off it, nothing changes
    if _holders == 0:
        _exiting = False
        for signum in EXIT_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:  # a handler the program set itself is kept
                _previous[signum] = signal.signal(signum, _raise_system_exit)
    _holders += 1
    return True


def _release() -> None:
    global _holders
    if threading.current_thread() is not threading.main_thread() or _holders == 0:
        return
    _holders -= 1
    if _holders == 0:
        for signum, handler in _previous.items():
            if signal.getsignal(signum) is _raise_system_exit:
                signal.signal(signum, handler)
        _previous.clear()


class _ExitsThroughPython(contextlib.ContextDecorator):
    def __enter__(self) -> None:
        _hold()

    def __exit__(self, *exc: object) -> None:
        _release()


def exits_through_python() -> _ExitsThroughPython:
    """``SIGTERM`` and ``SIGHUP`` raise ``SystemExit(128 + signal)`` while this holds (decorator or ``with``),
    so ``finally``/``with``/``atexit`` clean-up runs as on Ctrl-C; the previous handlers come back after.
    Nests; keeps a handler the program installed itself; does nothing off the main thread."""
    return _ExitsThroughPython()


def hold_exit_handlers() -> bool:
    """:func:`exits_through_python` for owners whose life is not one block (an object opened and closed
    later, such as ``VethLink``). Returns whether it held (not off the main thread); pair every call that
    did with one :func:`release_exit_handlers`."""
    return _hold()


def release_exit_handlers() -> None:
    """Undo one :func:`hold_exit_handlers`."""
    _release()


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owned_name(prefix: str) -> str:
    """``<prefix>-<this pid>-``: the start of a name that :func:`remove_stale_directories` can trace back to
    its creator (``prefix``: letters, digits, ``_`` and ``-``)."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", prefix):
        raise ValueError(f"prefix={prefix!r} must be a letter then letters, digits, '_' or '-'")
    return f"{prefix}-{os.getpid()}-"


def remove_stale_directories(prefix: str, parent: str | None = None) -> list[str]:
    """Delete the directories ``<prefix>-<pid>-...`` in ``parent`` (default: the system's temporary
    directory) whose process ``pid`` is gone; the paths deleted."""
    parent = parent or tempfile.gettempdir()
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-.*")
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            match = pattern.fullmatch(name)
            path = os.path.join(parent, name)
            if match and not pid_alive(int(match.group(1))) and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


@contextlib.contextmanager
def temporary_directory(prefix: str, parent: str | None = None, keep: bool = False) -> Iterator[str]:
    """A new directory ``<prefix>-<pid>-XXXX`` in ``parent`` (default: the system's temporary directory),
    deleted when the block ends (``keep=True``: left for the user to read). Directories of the same prefix
    whose process is gone (a run killed by ``SIGKILL``) are deleted first."""
    remove_stale_directories(prefix, parent)
    path = tempfile.mkdtemp(prefix=owned_name(prefix), dir=parent)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
