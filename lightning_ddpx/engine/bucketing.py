"""Pure bucket planning: which parameters share a flat gradient buffer, and where each one sits in it.

No process group here, so the rules are testable in one process. Buckets are formed along an order that
approximates when gradients become ready (reverse parameter order at construction, the observed ready
order after the first iteration), because a bucket can only be launched once all its gradients exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

__all__ = ["BucketInfo", "BucketSpec", "plan_buckets", "megabytes_to_bytes"]

_MB = 1024 * 1024


def megabytes_to_bytes(megabytes: float) -> int:
    """MiB to bytes, as torch interprets ``bucket_cap_mb``."""
    return int(megabytes * _MB)


@dataclass(frozen=True)
class BucketSpec:
    """One planned bucket: parameter indices (into the module's trainable parameters) in buffer order."""

    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]  # start of each parameter's gradient in the flat buffer, in elements
    numel: int  # total elements of the flat buffer
    dtype: torch.dtype
    device: torch.device

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
) -> list[BucketSpec]:
    """Group parameters into buckets along ``order``.

    Walking ``order``, each parameter joins the open bucket of its (dtype, device); a bucket is closed
    before a parameter would push it over its cap, so no bucket exceeds the cap unless a single
    parameter alone does. The first bucket of each (dtype, device) uses ``first_cap_bytes`` so the first
    launch happens early in backward. Buckets come out in the order they were opened along ``order``.
    """
    if sorted(order) != list(range(len(numels))):
        raise ValueError(f"order must be a permutation of range({len(numels)}), got {list(order)!r}")
    if first_cap_bytes <= 0 or cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got first={first_cap_bytes}, cap={cap_bytes}")
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_count: dict[Hashable, int] = {}
    finished: list[tuple[int, list[int]]] = []  # (opening position, indices)
    opened_at: dict[Hashable, int] = {}
    for position, index in enumerate(order):
        key = (dtypes[index], devices[index])
        size = numels[index] * torch.empty((), dtype=dtypes[index]).element_size()
        cap = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        members = open_buckets.get(key)
        if members and open_bytes[key] + size > cap:
            finished.append((opened_at[key], members))
            closed_count[key] = closed_count.get(key, 0) + 1
            members = None
        if not members:
            open_buckets[key] = members = []
            open_bytes[key] = 0
            opened_at[key] = position
        members.append(index)
        open_bytes[key] += size
    finished.extend((opened_at[key], members) for key, members in open_buckets.items() if members)
    finished.sort(key=lambda item: item[0])
    return [_spec(members, numels, dtypes, devices) for _, members in finished]


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
