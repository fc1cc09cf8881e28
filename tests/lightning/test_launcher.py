"""The sequenced launcher: hooks run one at a time in submission order, and a failed one stops the rest of
its reduction on this rank (its peers would pair their next collective with the wrong one otherwise)."""

from __future__ import annotations

import pytest
import torch

from lightning_ddpx.engine.transport.launcher import InlineLauncher, SequencedLauncher


def _done(value: int) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def test_a_failed_task_stops_the_rest_of_its_sequence_and_the_next_sequence_runs() -> None:
    launcher, ran = SequencedLauncher(name="test-launcher"), []

    def task(i: int) -> torch.futures.Future:
        ran.append(i)
        if i == 1:
            raise ValueError("bucket 1's hook failed before its second collective")
        return _done(i)

    try:
        launcher.begin_sequence()
        futures = [launcher.submit(task, i) for i in range(4)]
        assert futures[0].wait() == 0
        with pytest.raises(ValueError, match="bucket 1's hook failed"):
            futures[1].wait()
        for future in futures[2:]:
            with pytest.raises(
                RuntimeError, match=r"not run: an earlier hook call .* \(ValueError: bucket 1"
            ):
                future.wait()
        assert ran == [0, 1]  # 2 and 3 issued nothing
        launcher.begin_sequence()  # the next backward
        assert [launcher.submit(task, i).wait() for i in (2, 3)] == [2, 3]
        assert ran == [0, 1, 2, 3]
    finally:
        assert launcher.close()


def test_the_inline_launcher_raises_at_once() -> None:
    """An inline hook's error leaves the caller (backward) before any later bucket is launched."""
    launcher = InlineLauncher()
    launcher.begin_sequence()
    with pytest.raises(ZeroDivisionError):
        launcher.submit(lambda: 1 / 0)
    assert launcher.submit(_done, 5).wait() == 5
