"""The end of backward's one walk (engine/reducer/results_in_order.py), with a stand-in reducer: buckets in launch
order, the used-parameter bitmap waited for once, every second of waiting counted."""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_ddpx.engine.reducer.results_in_order import ResultsInOrder


class _Reducer:
    """What ResultsInOrder reads from a reducer: its buckets, each bucket's result, the counts."""

    def __init__(self, buckets: int, recorded: list[int] | None = None) -> None:
        self.buckets = [object()] * buckets
        self.waited_for: list[Any] = []
        self._recorded = recorded

    def wait_bucket(self, b: int) -> torch.Tensor:
        time.sleep(0.01)
        self.waited_for.append(b)
        return torch.full((2,), float(b))

    def recorded_counts(self) -> list[int] | None:
        return self._recorded

    def shared_counts(self, bitmap: torch.futures.Future) -> list[int]:
        self.waited_for.append("bitmap")
        return bitmap.wait()[0].tolist()


def _bitmap(counts: list[int]) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result([torch.tensor(counts)])
    return future


def test_buckets_arrive_in_launch_order_and_the_waiting_is_counted() -> None:
    reducer = _Reducer(3)
    results = ResultsInOrder(reducer, None)  # type: ignore[arg-type]
    assert [b for b, _ in results] == [0, 1, 2]
    assert reducer.waited_for == [0, 1, 2]
    assert results.waited >= 0.03
    assert not results.counts_pending and results.counts() is None  # no bitmap: every parameter used


def test_the_bitmap_is_waited_for_once_and_replaces_the_recorded_counts() -> None:
    reducer = _Reducer(2, recorded=[1, 1, 1])
    results = ResultsInOrder(reducer, _bitmap([2, 0, 1]))  # type: ignore[arg-type]
    assert results.counts_pending and results.known_counts == [1, 1, 1]
    assert results.counts() == [2, 0, 1]
    assert results.counts() == [2, 0, 1] and not results.counts_pending
    assert reducer.waited_for == ["bitmap"]
    started = results.last_arrival
    list(results)
    assert results.last_arrival > started and reducer.waited_for == ["bitmap", 0, 1]


def test_without_a_bitmap_the_static_graphs_record_is_the_answer() -> None:
    results = ResultsInOrder(_Reducer(1, recorded=[0, 2]), None)  # type: ignore[arg-type]
    assert results.counts() == [0, 2]
