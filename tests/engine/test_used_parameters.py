"""torch's used maps (lightning_ddpx.engine.reducer.used_parameters), without a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ddpx.engine.reducer.static_graph import StaticGraph
from lightning_ddpx.engine.reducer.used_parameters import UsedParameters


def test_clear_keeps_the_map_that_hooks_hold() -> None:
    used = UsedParameters(3)
    held = used.local
    held[1] = 1
    used.clear()
    assert used.local is held and list(held) == [0, 0, 0]


def test_marks_follow_each_parameter_to_its_new_index() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    used = UsedParameters(3)
    used.local[0] = used.local[2] = 1  # a and c got no_sync gradients
    carried = used.carried_over([a, b, c], [c, b])  # a frozen, order changed
    assert list(carried.local) == [1, 0]


def test_counts_are_the_bitmap_result_and_a_static_graph_records_them() -> None:
    launched: torch.futures.Future = torch.futures.Future()
    launched.set_result([torch.tensor([2, 0, 1], dtype=torch.int32)])
    static = StaticGraph(["w", "b", "c"])
    assert UsedParameters.counts(launched, dist.group.WORLD, static) == [2, 0, 1]
    assert static.globally_used == [2, 0, 1]
    assert UsedParameters.counts(launched, dist.group.WORLD, None) == [2, 0, 1]
