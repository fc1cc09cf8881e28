"""Where each gradient sits in a bucket: offsets and shapes read off a bucket once, for any hook.

Pure planning, no process group. Works for our :class:`~lightning_ddpx.GradBucket` and torch's
``GradBucket`` alike; the compression wrappers and PowerSGD (:mod:`lightning_ddpx.hooks.powersgd.plan`)
build on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["TensorSlot", "bucket_key", "bucket_layout", "layout_signature", "segment_sizes"]


@dataclass(frozen=True)
class TensorSlot:
    """One gradient in a flat bucket: ``buffer[offset : offset + numel]`` viewed as ``shape``."""

    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def bucket_key(bucket: Any) -> tuple:
    """What identifies a bucket's layout, cheaply enough to check every step.

    Size and dtype alone miss a rebuild that reorders the same parameters (torch's DDP and ours both
    rebuild buckets after the first iteration), so the identities of the parameters, in order, are part
    of the key.
    """
    buffer = bucket.buffer()
    return buffer.numel(), buffer.dtype, buffer.device, tuple(map(id, bucket.parameters()))


def layout_signature(slots: Sequence[TensorSlot]) -> tuple[int, ...]:
    """A flat tuple of ints describing a layout (offset, ndim, *shape per gradient), for checkpoints.

    PowerSGD memory saved for one layout must not be applied to another one of the same size.
    """
    return tuple(v for slot in slots for v in (slot.offset, len(slot.shape), *slot.shape))


def bucket_layout(bucket: Any) -> tuple[TensorSlot, ...]:
    """Offsets and shapes of a bucket's gradients inside ``bucket.buffer()``.

    Works for our :class:`~lightning_ddpx.GradBucket` and torch's ``GradBucket``: gradients are views
    into the buffer, so their storage offsets give their positions (gaps between them are allowed).
    Gradients that do not share the buffer's storage are taken to be packed back to back in order.
    """
    buffer = bucket.buffer()
    gradients = bucket.gradients()
    storage = buffer.untyped_storage().data_ptr()
    base = buffer.storage_offset()
    slots = []
    if all(g.untyped_storage().data_ptr() == storage for g in gradients):
        slots = [TensorSlot(g.storage_offset() - base, tuple(g.shape)) for g in gradients]
    else:
        offset = 0
        for g in gradients:
            slots.append(TensorSlot(offset, tuple(g.shape)))
            offset += g.numel()
    end = 0
    for slot in sorted(slots, key=lambda s: s.offset):
        if slot.offset < end or slot.offset + slot.numel > buffer.numel():
            raise ValueError(
                f"bucket {bucket.index()}: gradient of shape {slot.shape} at offset {slot.offset} overlaps "
                f"another gradient or runs past the buffer ({buffer.numel()} elements); a bucket's gradients "
                "must be disjoint views into its flat buffer."
            )
        end = slot.offset + slot.numel
    return tuple(slots)


def segment_sizes(numel: int, slots: Sequence[TensorSlot]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split sizes covering ``[0, numel)`` (gaps included), and each slot's index among the segments.

    ``buffer.split(sizes)`` then yields every slot's flat view in one call instead of one slice per tensor.
    """
    order = sorted(range(len(slots)), key=lambda i: slots[i].offset)
    sizes: list[int] = []
    where = [0] * len(slots)
    cursor = 0
    for i in order:
        slot = slots[i]
        if slot.offset > cursor:
            sizes.append(slot.offset - cursor)
        where[i] = len(sizes)
        sizes.append(slot.numel)
        cursor = slot.offset + slot.numel
    if cursor < numel:
        sizes.append(numel - cursor)
    return tuple(sizes), tuple(where)
