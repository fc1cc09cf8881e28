"""How PowerSGD packs a bucket for batched maths.

:func:`plan_powersgd` decides per gradient whether it is compressed and lays the compressed matrices out
grouped by shape, so that each group is one ``(batch, rows, cols)`` tensor and the hook's cost grows
with the number of distinct shapes, not the number of tensors. Groups appear in order of first
occurrence of their shape and keep bucket order inside, exactly as torch's hook orders its P and Q
memory, so the random initial Q matrices come out the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_ddpx.hooks.layout import TensorSlot
from lightning_ddpx.hooks.powersgd.lowrank import effective_rank, matrix_shape, should_compress

__all__ = ["MatrixGroup", "PowerSGDPlan", "plan_powersgd"]


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
