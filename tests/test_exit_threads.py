"""Our background threads are stopped at exit through one registry (lightning_ddpx/engine/exit_threads.py)."""

from __future__ import annotations

import threading

import torch

from lightning_ddpx.engine import exit_threads
from lightning_ddpx.engine.launcher import SequencedLauncher


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
