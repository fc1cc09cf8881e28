"""Carry PowerSGD memory across bucket layouts, parameter by parameter.

Error feedback and warm-start Q belong to gradient matrices, i.e. to parameters, but the hook keeps them
packed per bucket for speed. When the buckets change -- rebuilt after the first iteration, a fresh module
that starts in declaration order (torch's documented resume recipe: save ``state.state_dict()``, build a
new module, load, register), another ``bucket_cap_mb`` -- the memory of each parameter is cut out of the
old packing (:func:`explode`) and placed into the new one (:func:`assemble`), so training continues with
the same numbers instead of resetting. Pure functions over :class:`~lightning_ddpx.hooks.layout.PowerSGDPlan`;
parameters are identified by name (``GradBucket.parameter_names()``, which our engine provides).

Only the tensor-wise hook's memory is per parameter; the batched hook compresses the whole bucket as one
square, whose Q has no per-parameter meaning, so it still resets when the layout changes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_ddpx.hooks.layout import TensorSlot
from lightning_ddpx.hooks.powersgd.plan import PowerSGDPlan

__all__ = ["assemble", "explode", "slots_of"]


def slots_of(signature: Sequence[int]) -> tuple[TensorSlot, ...]:
    """The slots a tensor-wise layout signature (``layout_signature``) describes."""
    slots, i = [], 0
    while i < len(signature):
        offset, ndim = signature[i], signature[i + 1]
        slots.append(TensorSlot(offset, tuple(signature[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    return tuple(slots)


def _pieces(plan: PowerSGDPlan, names: Sequence[str]):
    """(name, Q range, error range, Q shape, error shape) of every compressed matrix of ``plan``."""
    for group in plan.groups:
        q_size, x_size = group.cols * group.rank, group.rows * group.cols
        for j, slot_index in enumerate(group.members):
            q_start, x_start = group.q_offset + j * q_size, group.packed_offset + j * x_size
            yield (
                names[slot_index],
                slice(q_start, q_start + q_size),
                slice(x_start, x_start + x_size),
                (group.cols, group.rank),
                (group.rows, group.cols),
            )


def explode(
    plan: PowerSGDPlan,
    names: Sequence[str],
    q: torch.Tensor | None,
    error: torch.Tensor | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-parameter copies of a bucket's packed warm-start ``q`` and ``error`` (either may be ``None``)."""
    q_pieces: dict[str, torch.Tensor] = {}
    error_pieces: dict[str, torch.Tensor] = {}
    for name, q_range, x_range, q_shape, x_shape in _pieces(plan, names):
        if q is not None:
            q_pieces[name] = q[q_range].reshape(q_shape).clone()
        if error is not None:
            error_pieces[name] = error[x_range].reshape(x_shape).clone()
    return q_pieces, error_pieces


def assemble(
    plan: PowerSGDPlan,
    names: Sequence[str],
    pool: dict[str, torch.Tensor],
    out: torch.Tensor,
    kind: str,
) -> bool:
    """Move this bucket's pieces of ``kind`` (``"q"`` or ``"error"``) from ``pool`` into the packed ``out``.

    Pieces of the wrong shape (saved with other options) are dropped. Returns whether every compressed
    matrix of the bucket found its piece; matrices without one are left as ``out`` holds them.
    """
    complete = True
    for name, q_range, x_range, q_shape, x_shape in _pieces(plan, names):
        where, shape = (q_range, q_shape) if kind == "q" else (x_range, x_shape)
        piece = pool.pop(name, None)
        if piece is None or tuple(piece.shape) != shape:
            complete = False
            continue
        out[where].copy_(piece.reshape(-1))
    return complete
