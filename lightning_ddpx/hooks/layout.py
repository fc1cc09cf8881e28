"""Where each gradient sits in a bucket, and how PowerSGD packs a bucket for batched maths.

Pure planning, no process group: :func:`bucket_layout` reads offsets and shapes off a bucket once,
:func:`plan_powersgd` decides per gradient whether it is compressed and lays the compressed matrices out
grouped by shape, so that each group is one ``(batch, rows, cols)`` tensor and the hook's cost grows
with the number of distinct shapes, not the number of tensors. Groups appear in order of first
occurrence of their shape and keep bucket order inside, exactly as torch's hook orders its P and Q
memory, so the random initial Q matrices come out the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from lightning_ddpx.hooks.lowrank import effective_rank, matrix_shape, should_compress

__all__ = [
    "MatrixGroup",
    "PowerSGDPlan",
    "TensorSlot",
    "bucket_key",
    "bucket_layout",
    "layout_signature",
    "plan_powersgd",
    "segment_sizes",
]


@dataclass(frozen=True)
class TensorSlot:
    """One gradient in a flat bucket: ``buffer[offset : offset + numel]`` viewed as ``shape``."""

    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class MatrixGroup:
    """Compressed gradients sharing one matrix shape, packed as one ``(batch, rows, cols)`` block."""

    rows: int
    cols: int
    rank: int  # effective approximation rank for this shape
    members: tuple[int, ...]  # indices into the bucket's slots, in bucket order
    packed_offset: int  # start of the block in the packed matrix buffer (and error buffer)
    p_offset: int  # start of this group's (batch, rows, rank) block in P memory
    q_offset: int  # start of this group's (batch, cols, rank) block in Q memory

    @property
    def batch(self) -> int:
        return len(self.members)

    @property
    def matrix_numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class PowerSGDPlan:
    """How one bucket is compressed: which slots go through PowerSGD, in which packed order."""

    numel: int  # elements in the bucket buffer
    slots: tuple[TensorSlot, ...]
    groups: tuple[MatrixGroup, ...]
    uncompressed: tuple[int, ...]  # slot indices allreduced as they are, in bucket order
    packed_numel: int  # elements of all compressed matrices
    p_numel: int
    q_numel: int
    uncompressed_numel: int
    q_draw_sizes: tuple[int, ...]  # consecutive slices of Q memory filled by one random draw each
    numel_before: int  # elements entering this bucket's compression (statistics)
    numel_after: int  # elements sent: P, Q and the uncompressed gradients (statistics)

    @property
    def compressed(self) -> tuple[int, ...]:
        """Slot indices of compressed gradients, in packed order."""
        return tuple(i for group in self.groups for i in group.members)


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


def plan_powersgd(
    numel: int,
    slots: Sequence[TensorSlot],
    rank: int,
    min_compression_rate: float,
    batch_random_draws: bool,
) -> PowerSGDPlan:
    """Decide, per gradient, compressed or not, and pack the compressed ones grouped by matrix shape.

    ``batch_random_draws`` reproduces torch's ``batch_tensors_with_same_shape``: one random draw per
    shape group instead of one per tensor (the numbers differ, so it must match to compare with torch).
    """
    by_shape: dict[tuple[int, int], list[int]] = {}
    uncompressed: list[int] = []
    before = after = 0
    for index, slot in enumerate(slots):
        rows, cols = matrix_shape(slot.shape)
        r = effective_rank(rows, cols, rank)
        before += rows * cols
        if r > 0 and should_compress(rows, cols, r, min_compression_rate):
            by_shape.setdefault((rows, cols), []).append(index)
            after += (rows + cols) * r
        else:
            uncompressed.append(index)
            after += rows * cols
    groups = []
    draws: list[int] = []
    packed = p = q = 0
    for (rows, cols), members in by_shape.items():
        r = effective_rank(rows, cols, rank)
        groups.append(MatrixGroup(rows, cols, r, tuple(members), packed, p, q))
        if batch_random_draws:
            draws.append(len(members) * cols * r)
        else:
            draws.extend([cols * r] * len(members))
        packed += len(members) * rows * cols
        p += len(members) * rows * r
        q += len(members) * cols * r
    return PowerSGDPlan(
        numel=numel,
        slots=tuple(slots),
        groups=tuple(groups),
        uncompressed=tuple(uncompressed),
        packed_numel=packed,
        p_numel=p,
        q_numel=q,
        uncompressed_numel=sum(slots[i].numel for i in uncompressed),
        q_draw_sizes=tuple(draws),
        numel_before=before,
        numel_after=after,
    )
