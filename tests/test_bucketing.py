"""Bucket planning rules, in one process (no process group)."""

from __future__ import annotations

import pytest
import torch

from lightning_ddpx.engine.bucketing import megabytes_to_bytes, plan_buckets
from lightning_ddpx.engine.graph import iter_tensors, reachable_parameter_indices

F32, F16, CPU = torch.float32, torch.float16, torch.device("cpu")


def plan(numels, order=None, first=16, cap=40, dtypes=None):
    dtypes = dtypes or [F32] * len(numels)
    order = order if order is not None else list(reversed(range(len(numels))))
    return plan_buckets(numels, dtypes, [CPU] * len(numels), order, first, cap)


def test_reverse_order_with_small_first_bucket_and_cap():
    # 4 bytes per element: caps of 16 and 40 bytes are 4 and 10 elements.
    buckets = plan([3, 3, 3, 3, 3])
    assert [b.param_indices for b in buckets] == [(4,), (3, 2, 1), (0,)]
    for b in buckets:
        assert b.offsets == tuple(3 * k for k in range(len(b.param_indices)))
        assert b.numel == 3 * len(b.param_indices)


def test_every_parameter_exactly_once_and_caps_respected():
    numels = [5, 1, 7, 2, 2, 9, 4, 1, 3]
    buckets = plan(numels, first=12, cap=32)
    seen = [i for b in buckets for i in b.param_indices]
    assert sorted(seen) == list(range(len(numels)))
    assert buckets[0].num_bytes <= 12 or len(buckets[0].param_indices) == 1
    for b in buckets[1:]:
        assert b.num_bytes <= 32 or len(b.param_indices) == 1


def test_oversized_parameter_gets_its_own_bucket():
    buckets = plan([2, 100, 2], first=40, cap=40)
    assert (1,) in [b.param_indices for b in buckets]


def test_dtypes_never_mix_and_each_dtype_gets_a_small_first_bucket():
    buckets = plan([4, 4, 4, 4], dtypes=[F32, F16, F32, F16], first=16, cap=64)
    for b in buckets:
        assert len({F32 if i % 2 == 0 else F16 for i in b.param_indices}) == 1
        assert b.dtype == (F32 if b.param_indices[0] % 2 == 0 else F16)


def test_follows_given_order():
    buckets = plan([1, 1, 1, 1], order=[2, 0, 3, 1], first=8, cap=8)
    assert [b.param_indices for b in buckets] == [(2, 0), (3, 1)]


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="permutation"):
        plan([1, 1], order=[0, 0])
    with pytest.raises(ValueError, match="positive"):
        plan([1, 1], first=0)


def test_megabytes():
    assert megabytes_to_bytes(25) == 25 * 1024 * 1024
    assert megabytes_to_bytes(0.5) == 512 * 1024


def test_graph_walk_finds_only_reachable_parameters():
    from dataclasses import dataclass

    lin_a, lin_b, lin_c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    params = [*lin_a.parameters(), *lin_b.parameters(), *lin_c.parameters()]
    index_of = {id(p): i for i, p in enumerate(params)}

    @dataclass
    class Out:
        logits: torch.Tensor
        extra: dict

    x = torch.randn(1, 2)
    out = Out(lin_a(x), {"aux": [lin_b(x).detach(), (lin_c.weight,)]})
    assert len(list(iter_tensors(out))) == 3
    # lin_b's output is detached, so only lin_a's parameters and lin_c.weight (returned itself) are reachable.
    assert reachable_parameter_indices(out, index_of) == {0, 1, 4}
