"""Pure bucket planning: which parameters share a flat gradient buffer, and where each one sits in it.

No process group here, so the rules are testable in one process. Buckets are formed along an order that
approximates when gradients become ready (torch's construction-time plan at first, the observed ready
order after the first iteration), because a bucket can only be launched once all its gradients exist.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Hashable, Sequence

import torch

from lightning_ddpx.engine.option_values import is_finite_number

__all__ = [
    "BucketInfo",
    "BucketSpec",
    "chunk_ranges",
    "megabytes_to_bytes",
    "plan_buckets",
    "plan_initial_buckets",
    "resolve_bucket_caps",
]

_MB = 1024 * 1024


def megabytes_to_bytes(megabytes: float) -> int:
    """MiB to bytes, as torch interprets ``bucket_cap_mb``."""
    return int(megabytes * _MB)


DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES


def is_bucket_cap(value: object) -> bool:
    """Whether ``value`` is a valid ``bucket_cap_mb`` / ``first_bucket_cap_mb``: a finite number of MiB of at
    least one byte (not a bool; a cap that rounds to 0 bytes, or an infinite one, has no bucket size), or
    ``None`` for torch's default. One rule for the module and the strategies' options."""
    if value is None:
        return True
    if not isinstance(value, (int, float)) or not is_finite_number(value):
        return False
    size = float(value) * _MB
    return math.isfinite(size) and int(size) >= 1  # 1e303 MiB is a finite number, but no byte count


def resolve_bucket_caps(
    bucket_cap_mb: float | None, first_bucket_cap_mb: float | None
) -> tuple[float, float]:
    """(first bucket's cap, every other bucket's cap) in MiB, by torch's rule: ``bucket_cap_mb=None`` (its
    default) means 25 MiB buckets after a 1 MiB first one; an explicit ``bucket_cap_mb`` sizes every bucket,
    the first included. ``first_bucket_cap_mb`` (ours, ``None`` by default) sets the first one explicitly.
    The same caps give the same buckets as torch's DDP, and so, past two ranks, the same sums."""
    cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)  # 25 and 25.0: one setting
    if first_bucket_cap_mb is not None:
        return float(first_bucket_cap_mb), cap
    return (DEFAULT_FIRST_BUCKET_CAP_MB if bucket_cap_mb is None else cap), cap


@dataclass(frozen=True)
class BucketSpec:
    """One planned bucket: parameter indices (into the module's trainable parameters) in buffer order."""

    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]  # start of each parameter's gradient in the flat buffer, in elements
    numel: int  # total elements of the flat buffer
    dtype: torch.dtype
    device: torch.device
    sparse: bool = (
        False  # one parameter whose gradient is a sparse tensor (lightning_ddpx.engine.buckets.sparse)
    )

    @property
    def num_bytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BucketInfo:
    """What a user sees of a bucket (``DistributedDataParallel.bucket_plan()``)."""

    index: int
    num_bytes: int
    dtype: torch.dtype
    device: torch.device
    parameter_names: tuple[str, ...]


def plan_buckets(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    order: Sequence[int],
    first_cap_bytes: int,
    cap_bytes: int,
    last_cap_bytes: int | None = None,
    sparse: Sequence[bool] | None = None,
) -> list[BucketSpec]:
    """Group parameters into buckets along ``order``, by torch's rule (its C++
    ``compute_bucket_assignment_by_size``), so the same caps give the same buckets as torch's DDP.

    Walking ``order``, each parameter joins the open bucket of its (dtype, device); the bucket closes as
    soon as it holds ``cap`` bytes or more. So a bucket exceeds its cap by less than its last parameter,
    and a large gradient is launched the moment it is ready instead of waiting for the next layer's small
    ones (closing *before* the cap would be crossed, as this planner once did, put each 16 MB weight of the
    benchmark MLP in a bucket with the next layer's bias: 6 buckets where torch makes 3, each launched one
    layer later, 5 % slower over a 1 Gbit/s link). The first bucket of each (dtype, device) uses
    ``first_cap_bytes`` so the first launch happens early in backward. Buckets come out in the order they
    closed (the order they become ready), then the ones still open at the end, in the order they opened.

    ``last_cap_bytes`` (not torch's): the last bucket is split so that only its trailing parameters, the
    fewest reaching that size, stay in it. Used with ``overlap_optimizer_with``, whose update of the last
    bucket cannot hide behind any communication: on the benchmark MLP it shrinks from 2 layers to 1.

    ``sparse[i]``: parameter ``i`` produces sparse gradients; it gets a bucket of its own, closed where it
    comes in ``order`` (torch's rule), which does not count as the first bucket of its dtype.
    """
    if sorted(order) != list(range(len(numels))):
        raise ValueError(f"order must be a permutation of range({len(numels)}), got {list(order)!r}")
    if first_cap_bytes <= 0 or cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got first={first_cap_bytes}, cap={cap_bytes}")
    open_buckets: dict[Hashable, list[int]] = {}  # insertion order: the order they opened
    open_bytes: dict[Hashable, int] = {}
    closed_count: dict[Hashable, int] = {}
    finished: list[list[int]] = []
    for index in order:
        if sparse is not None and sparse[index]:
            finished.append([index])
            continue
        key = (dtypes[index], devices[index])
        members = open_buckets.setdefault(key, [])
        members.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + numels[index] * _element_size(dtypes[index])
        cap = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= cap:
            finished.append(members)
            closed_count[key] = closed_count.get(key, 0) + 1
            del open_buckets[key], open_bytes[key]
    finished.extend(open_buckets.values())
    if last_cap_bytes is not None and finished:
        finished[-1:] = _split_tail(finished[-1], numels, dtypes, last_cap_bytes)
    specs = [_spec(members, numels, dtypes, devices) for members in finished]
    if sparse is not None:
        specs = [replace(spec, sparse=True) if sparse[spec.param_indices[0]] else spec for spec in specs]
    return specs


def plan_initial_buckets(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    first_cap_bytes: int,
    cap_bytes: int,
    one_bucket: bool,
    sparse: Sequence[bool] | None = None,
) -> list[BucketSpec]:
    """torch's layout at construction, used until the first rebuild (or for good where none comes).

    torch assigns buckets along *parameter* order, sorts them by their lowest parameter index and launches
    them in reverse, each keeping parameter order inside. With ``one_bucket`` (torch: no
    ``find_unused_parameters``, or ``static_graph``, where parameter order may be far from the ready order
    and the rebuild will follow the observed one) every (dtype, device) gets one bucket; otherwise the caps
    apply, the small first cap to the parameters defined first, whose gradients are ready last. The layout
    matters beyond speed: past two ranks the ring all-reduce's summation order depends on where each
    gradient sits in its buffer, so only torch's layout gives torch's sums bit for bit.
    """
    first, cap = (sys.maxsize, sys.maxsize) if one_bucket else (first_cap_bytes, cap_bytes)  # torch's limit
    specs = plan_buckets(numels, dtypes, devices, range(len(numels)), first, cap, sparse=sparse)
    return sorted(specs, key=lambda spec: spec.param_indices[0], reverse=True)


def _split_tail(
    members: list[int], numels: Sequence[int], dtypes: Sequence[torch.dtype], cap_bytes: int
) -> list[list[int]]:
    """``members`` as [head, tail]: the tail is the fewest trailing members holding ``cap_bytes`` or more
    (torch's rule, walked backwards); one bucket when that is all of them."""
    size = 0
    for start in range(len(members) - 1, -1, -1):
        size += numels[members[start]] * _element_size(dtypes[members[start]])
        if size >= cap_bytes:
            break
    return [members[:start], members[start:]] if start > 0 else [members]


# Cuts inside a parameter fall on multiples of this many elements from its start, so every piece but its
# last covers whole vector blocks of the elementwise kernels and the last piece keeps the whole parameter's
# tail: the piecewise update then computes each element exactly as the whole update does.
CHUNK_ALIGN_ELEMENTS = 1024


def chunk_ranges(offsets: Sequence[int], numels: Sequence[int], chunk_numel: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, end)`` that cover a bucket in order, each about ``chunk_numel`` long.

    Used to reduce one bucket in several collectives whose results arrive one after another (the overlap's
    last bucket). Small parameters are grouped whole; a parameter longer than ``chunk_numel`` starts a
    range and is cut at multiples of ``chunk_numel`` (rounded up to :data:`CHUNK_ALIGN_ELEMENTS`) from its
    own start. ``offsets``/``numels``: the bucket's parameters in buffer order (contiguous, from 0).
    """
    if chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
    step = -(-chunk_numel // CHUNK_ALIGN_ELEMENTS) * CHUNK_ALIGN_ELEMENTS
    cuts: list[int] = []
    start = 0
    for offset, numel in zip(offsets, numels):
        end = offset + numel
        if numel > step:
            if offset > start:
                cuts.append(offset)
            cuts.extend(range(offset + step, end, step))
            cuts.append(end)
            start = end
        elif end - start >= chunk_numel:
            cuts.append(end)
            start = end
    total = offsets[-1] + numels[-1] if offsets else 0
    if start < total:
        cuts.append(total)
    return list(zip([0, *cuts[:-1]], cuts))


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _spec(
    members: list[int],
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
) -> BucketSpec:
    offsets = []
    total = 0
    for index in members:
        offsets.append(total)
        total += numels[index]
    return BucketSpec(tuple(members), tuple(offsets), total, dtypes[members[0]], devices[members[0]])
