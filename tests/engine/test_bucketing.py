"""Bucket planning rules, in one process (no process group)."""

from __future__ import annotations

import pytest
import torch

from lightning_ddpx.engine.buckets.plan import (
    megabytes_to_bytes,
    plan_buckets,
    plan_initial_buckets,
    resolve_bucket_caps,
)
from lightning_ddpx.engine.reducer.reachability import iter_tensors, reachable_parameter_indices

F32, F16, CPU = torch.float32, torch.float16, torch.device("cpu")


def plan(numels, order=None, first=16, cap=40, dtypes=None):
    dtypes = dtypes or [F32] * len(numels)
    order = order if order is not None else list(reversed(range(len(numels))))
    return plan_buckets(numels, dtypes, [CPU] * len(numels), order, first, cap)


def test_reverse_order_with_small_first_bucket_and_cap():
    # 4 bytes per element: caps of 16 and 40 bytes are 4 and 10 elements; a bucket closes once it reaches its cap.
    buckets = plan([3, 3, 3, 3, 3])
    assert [b.param_indices for b in buckets] == [(4, 3), (2, 1, 0)]
    for b in buckets:
        assert b.offsets == tuple(3 * k for k in range(len(b.param_indices)))
        assert b.numel == 3 * len(b.param_indices)


def test_every_parameter_exactly_once_and_a_bucket_exceeds_its_cap_by_less_than_its_last_parameter():
    numels = [5, 1, 7, 2, 2, 9, 4, 1, 3]
    buckets = plan(numels, first=12, cap=32)
    seen = [i for b in buckets for i in b.param_indices]
    assert sorted(seen) == list(range(len(numels)))
    for k, b in enumerate(buckets):
        cap = 12 if k == 0 else 32
        assert b.num_bytes - 4 * numels[b.param_indices[-1]] < cap, (k, b)
        if k < len(buckets) - 1:
            assert b.num_bytes >= cap, f"bucket {k} closed below its cap"


def test_a_large_parameter_closes_its_bucket_at_once():
    """The reason for torch's rule: a big gradient is launched as soon as it is ready, not held back until
    the next (small) parameter's gradient arrives."""
    buckets = plan([2, 100, 2], first=40, cap=40)
    assert [b.param_indices for b in buckets] == [(2, 1), (0,)]


def _torch_plan(numels, dtypes, order, first, cap):
    tensors = [torch.empty(numels[i], dtype=dtypes[i]) for i in order]
    buckets, _ = torch.distributed._compute_bucket_assignment_by_size(
        tensors, [first, cap], [False] * len(order), list(order)
    )
    return [tuple(b) for b in buckets]


@pytest.mark.parametrize("seed", range(40))
def test_same_buckets_as_torchs_planner(seed):
    """Oracle: torch's own planner (the one its DDP uses at construction and rebuild) on random sizes,
    orders and caps. One dtype: the same buckets in the same order. Mixed dtypes: the same buckets; torch
    lists those still open at the end in hash order, ours in the order they opened."""
    gen = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 30, (), generator=gen))
    numels = torch.randint(1, 200, (count,), generator=gen).tolist()
    order = torch.randperm(count, generator=gen).tolist()
    first, cap = (int(x) * 4 for x in torch.randint(1, 400, (2,), generator=gen))
    mixed = seed % 2 == 1
    dtypes = [F16 if mixed and n % 3 == 0 else F32 for n in numels]
    ours = [b.param_indices for b in plan_buckets(numels, dtypes, [CPU] * count, order, first, cap)]
    theirs = _torch_plan(numels, dtypes, order, first, cap)
    if mixed:
        assert sorted(ours) == sorted(theirs)
    else:
        assert ours == theirs


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("find_unused", [False, True], ids=["one_bucket", "find_unused"])
def test_initial_buckets_are_torchs_construction_time_buckets(seed, find_unused):
    """Oracle: what torch's DDP constructor plans (its planner along parameter order, with no cap unless
    find_unused_parameters, then the bucket list reversed), on random sizes, caps and dtypes: the same
    buckets, in the same order, each in parameter order. Past two ranks that decides the sums."""
    gen = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 30, (), generator=gen))
    numels = torch.randint(1, 200, (count,), generator=gen).tolist()
    first, cap = (int(x) * 4 for x in torch.randint(1, 400, (2,), generator=gen))
    dtypes = [F16 if seed % 2 and n % 3 == 0 else F32 for n in numels]
    ours = plan_initial_buckets(numels, dtypes, [CPU] * count, first, cap, one_bucket=not find_unused)
    tensors = [torch.empty(n, dtype=d) for n, d in zip(numels, dtypes)]
    limits = [first, cap] if find_unused else [2**62]
    theirs, _ = torch.distributed._compute_bucket_assignment_by_size(tensors, limits, [False] * count)
    assert [b.param_indices for b in ours] == [tuple(b) for b in reversed(theirs)]
    if not find_unused:
        assert len(ours) == len(set(dtypes))


def test_initial_bucket_holds_every_parameter_of_its_dtype_whatever_the_element_size():
    """No cap at all, as torch's sys.maxsize: 16-byte complex elements stay in one bucket too."""
    c128 = torch.complex128
    ours = plan_initial_buckets([10, 10, 10, 10], [c128, F32, c128, c128], [CPU] * 4, 16, 40, one_bucket=True)
    assert [b.param_indices for b in ours] == [(1,), (0, 2, 3)]
    ours = plan_initial_buckets([10, 10, 10], [c128] * 3, [CPU] * 3, 16, 40, one_bucket=True)
    assert [b.param_indices for b in ours] == [(0, 1, 2)]


def test_bucket_caps_follow_torchs_rule():
    """None: torch's 25 MiB after a 1 MiB first bucket; an explicit cap sizes the first bucket too (torch
    >= 2.3); first_bucket_cap_mb, ours, overrides the first."""
    assert resolve_bucket_caps(None, None) == (1.0, 25.0)
    assert resolve_bucket_caps(25, None) == (25, 25)
    assert resolve_bucket_caps(4, None) == (4, 4)
    assert resolve_bucket_caps(None, 0.5) == (0.5, 25.0)
    assert resolve_bucket_caps(8, 2) == (2, 8)


def test_dtypes_never_mix_and_each_dtype_gets_a_small_first_bucket():
    buckets = plan([4, 4, 4, 4], dtypes=[F32, F16, F32, F16], first=16, cap=64)
    for b in buckets:
        assert len({F32 if i % 2 == 0 else F16 for i in b.param_indices}) == 1
        assert b.dtype == (F32 if b.param_indices[0] % 2 == 0 else F16)


def test_follows_given_order():
    buckets = plan([1, 1, 1, 1], order=[2, 0, 3, 1], first=8, cap=12)
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


def test_last_cap_splits_only_the_last_bucket_to_its_trailing_parameters():
    """overlap_optimizer_with's plan: the last bucket keeps the fewest trailing parameters that reach
    ``last_cap`` (its update is the one no communication can hide); the other buckets are torch's."""
    numels = [3, 3, 3, 3, 3, 3]  # 12 bytes each; reversed order: 5 4 3 2 1 0
    torch_like = [b.param_indices for b in plan(numels, first=16, cap=40)]
    assert torch_like == [(5, 4), (3, 2, 1, 0)]
    split = plan_buckets(numels, [F32] * 6, [CPU] * 6, [5, 4, 3, 2, 1, 0], 16, 40, last_cap_bytes=16)
    assert [b.param_indices for b in split] == [(5, 4), (3, 2), (1, 0)]
    alone = plan_buckets([3, 100], [F32] * 2, [CPU] * 2, [1, 0], 16, 1000, last_cap_bytes=16)
    assert [b.param_indices for b in alone] == [
        (1,),
        (0,),
    ]  # the first bucket closed at once; nothing to split
    one = plan_buckets([3], [F32], [CPU], [0], 16, 40, last_cap_bytes=4)
    assert [b.param_indices for b in one] == [(0,)]


# ------------------------------------------------------------------------------------- chunk_ranges
def test_chunk_ranges_cut_large_parameters_from_their_own_start() -> None:
    from lightning_ddpx.engine.buckets.plan import CHUNK_ALIGN_ELEMENTS, chunk_ranges

    # two small parameters, one large (starting at 20, not aligned), one small after it
    offsets, numels = [0, 10, 20, 3000], [10, 10, 2980, 5000]
    ranges = chunk_ranges(offsets, numels, 2000)
    assert ranges == [(0, 20), (20, 2068), (2068, 3000), (3000, 5048), (5048, 7096), (7096, 8000)]
    assert [start for start, _ in ranges[1:]] == [end for _, end in ranges[:-1]], "contiguous"
    for offset, numel in zip(offsets, numels):  # every cut inside a parameter is aligned to its start
        inside = [end - offset for _, end in ranges if offset < end < offset + numel]
        assert all(cut % CHUNK_ALIGN_ELEMENTS == 0 for cut in inside)
    assert chunk_ranges([0], [4096], 4096) == [(0, 4096)]
    assert chunk_ranges([0, 100], [100, 100], 50) == [(0, 100), (100, 200)]
    with pytest.raises(ValueError, match="chunk_numel"):
        chunk_ranges([0], [10], 0)
