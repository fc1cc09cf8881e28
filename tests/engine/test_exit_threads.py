"""Our background threads are stopped at exit through one registry (lightning_ddpx/engine/exit_threads.py)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from lightning_ddpx.engine import exit_threads
from lightning_ddpx.engine.transport.launcher import SequencedLauncher


def test_started_threads_are_stopped_by_stop_all() -> None:
    launcher = SequencedLauncher(name="test-exit-threads")
    release = threading.Event()

    def blocked() -> torch.futures.Future:
        release.wait(5)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    launcher.submit(blocked)
    assert "test-exit-threads" in [name for name, _ in exit_threads._RUNNING.values()]
    assert "test-exit-threads" in [t.name for t in threading.enumerate()]
    release.set()
    assert "test-exit-threads" not in exit_threads.stop_all()
    assert "test-exit-threads" not in [t.name for t in threading.enumerate()]


def test_a_thread_that_does_not_end_is_named() -> None:
    class Stuck:
        def close(self, timeout: float | None = None) -> bool:
            return False

    stuck = Stuck()
    exit_threads.stop_at_exit(stuck, "stuck-thread", 0.01)
    assert "stuck-thread" in exit_threads.stop_all()
    del exit_threads._RUNNING[stuck]


def test_gloo_workers_are_found_and_seen_idle(tmp_path) -> None:
    """The exit handler's wait sees gloo's worker threads (a group of one, no default group needed) and
    returns once they are idle; the waiting itself is proven by tests/lightning/test_process_exit.py's repeated jobs."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/task: Linux only (elsewhere the handler sleeps instead)")
    before = set(exit_threads._gloo_worker_activity())
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    group = torch.distributed.ProcessGroupGloo(store, 0, 1)
    group.allreduce([torch.ones(4)]).wait()
    workers = set(exit_threads._gloo_worker_activity()) - before
    assert len(workers) >= 1, "no pt_gloo_runloop thread found in /proc/self/task"
    assert exit_threads.wait_for_idle_gloo_workers(timeout=5.0)
    del group
