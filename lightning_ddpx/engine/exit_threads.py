"""Our own background threads, stopped and joined before Python finalises.

Why: a daemon thread still inside a C++ call -- waiting on a collective's future, or writing to the
TCPStore, the GIL released -- when the interpreter finalises is killed as it re-takes the GIL, and the C++
runtime aborts the process ("terminate called without an active exception", exit code -6) instead of
letting it exit with its status. The communication thread (:mod:`~lightning_ddpx.engine.transport.launcher`) and the
progress writer (:mod:`~lightning_ddpx.engine.agreement.progress_board`) register here when their thread starts; one
``atexit`` handler stops them all, each waited for at most its own bound. The strategies' exit handler
(:mod:`lightning_ddpx.lightning.processes.process_exit`) calls :func:`stop_all` first, before destroying the group.

gloo's worker threads (``pt_gloo_runloop``) abort the process the same way: a worker drops its reference to a
finished collective -- and to the tensors it reduced -- a moment *after* the caller's ``wait()`` returned,
and releasing a tensor whose Python object is gone needs the GIL. If that moment falls after finalisation
began, Python ends the thread inside C++ and the runtime aborts (gdb: ``~AsyncAllreduceWork`` ->
``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``). Destroying the
group does not help while anything -- the user's model, torch's DDP, ours -- still references it: the
workers live on (measured, torch 2.13, two processes whose last act is one ``all_reduce``: 6 of 20 aborted
with a reference kept across ``destroy_process_group``, 4 of 20 after the backend's own ``shutdown()``).
So the same handler then waits, the GIL released, until every gloo worker is idle
(:func:`wait_for_idle_gloo_workers`); the module registers it when it is built.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import Protocol

__all__ = ["Stoppable", "register_exit_handler", "stop_all", "stop_at_exit", "wait_for_idle_gloo_workers"]

# gloo names its worker threads so (ProcessGroupGloo::runLoop); visible in /proc/self/task/*/comm.
GLOO_WORKER_THREAD_NAME = "pt_gloo_runloop"
# A worker counts as idle once it sat blocked, without a single context switch, this long; a worker waiting
# for the GIL wakes every 5 ms (sys.getswitchinterval()), one releasing a tensor runs: neither stays still.
IDLE_QUIET_S = 0.02
# Longest wait for gloo's workers at exit (an idle one is seen in IDLE_QUIET_S); where /proc cannot be
# read (not Linux), the handler sleeps FALLBACK_SLEEP_S instead, which covers all but a starved worker.
IDLE_TIMEOUT_S = 2.0
FALLBACK_SLEEP_S = 0.1


class Stoppable(Protocol):
    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread; wait up to ``timeout`` s for it; return whether it has ended."""
        ...


# owner -> (thread name for messages, longest wait at exit); weak: a collected owner stopped its thread.
_RUNNING: "weakref.WeakKeyDictionary[Stoppable, tuple[str, float]]" = weakref.WeakKeyDictionary()
_handler_registered = False


def register_exit_handler() -> None:
    """At interpreter exit, while the interpreter is whole: :func:`stop_all`, then
    :func:`wait_for_idle_gloo_workers` (registered once per process)."""
    global _handler_registered
    if not _handler_registered:
        atexit.register(_at_exit)
        _handler_registered = True


def _at_exit() -> None:
    stop_all()
    wait_for_idle_gloo_workers()


def stop_at_exit(owner: Stoppable, name: str, timeout: float) -> None:
    """Stop ``owner``'s thread at interpreter exit (``owner.close(timeout)``), unless it was collected first."""
    _RUNNING[owner] = (name, timeout)
    register_exit_handler()


def stop_all() -> list[str]:
    """Stop every registered thread, each waited for at most its bound; the names of those still running."""
    still_running = []
    for owner, (name, timeout) in list(_RUNNING.items()):
        if not owner.close(timeout):
            still_running.append(name)
    return still_running


def wait_for_idle_gloo_workers(timeout: float = IDLE_TIMEOUT_S) -> bool:
    """Wait, sleeping (the GIL released, so a worker that needs it gets it), until every gloo worker thread of
    this process is idle: blocked and not switched in for :data:`IDLE_QUIET_S`. Returns whether they all were
    within ``timeout`` s. No gloo group, or all destroyed: returns at once."""
    if not sys.platform.startswith("linux"):
        time.sleep(FALLBACK_SLEEP_S)
        return True
    deadline = time.monotonic() + timeout
    before = _gloo_worker_activity()
    while before:
        time.sleep(IDLE_QUIET_S)
        after = _gloo_worker_activity()
        if all(
            state == "S" and after.get(tid) == (state, switches) for tid, (state, switches) in before.items()
        ):
            return True
        if time.monotonic() > deadline:
            return False
        before = after
    return True


def _gloo_worker_activity() -> dict[str, tuple[str, int]]:
    """Each gloo worker thread's (scheduler state, context switches so far), by thread id; {} where /proc
    has no such thread (or cannot be read)."""
    activity = {}
    try:
        thread_ids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in thread_ids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER_THREAD_NAME:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except (OSError, IndexError, ValueError):
            continue  # the thread ended while we read
        activity[tid] = (state, switches)
    return activity
