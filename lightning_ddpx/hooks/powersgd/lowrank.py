"""The linear algebra of PowerSGD, as pure functions: which matrices are worth compressing, and
orthogonalisation of a batch of thin matrices.

No process group here, so every rule can be tested in one process. The choices mirror torch's
``powerSGD_hook`` (Gram-Schmidt up to rank 2 and in half precision, Householder QR above) so that our
hooks reproduce its numbers; see ``docs/hooks.md``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "effective_rank",
    "left_project_",
    "matrix_shape",
    "orthogonalize_",
    "right_project_",
    "should_compress",
    "square_side",
]

_HALF = (torch.float16, torch.bfloat16)


def matrix_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The matrix a gradient of ``shape`` is compressed as: first dimension by the rest.

    A conv weight ``(out, in, kh, kw)`` becomes ``(out, in * kh * kw)``, a bias ``(n,)`` becomes ``(n, 1)``
    and a scalar ``(1, 1)``, as in the PowerSGD paper and torch's hook.
    """
    if len(shape) == 0:
        return 1, 1
    rows = int(shape[0])
    numel = math.prod(int(d) for d in shape)
    return rows, (numel // rows if rows else 0)


def effective_rank(rows: int, cols: int, rank: int) -> int:
    """The approximation rank actually usable for a ``rows x cols`` matrix: at most ``min(rows, cols)``."""
    return min(rows, cols, rank)


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether sending P (rows x rank) and Q (cols x rank) saves at least ``min_compression_rate`` x.

    ``rank`` is the effective rank. The test is torch's: ``(rows + cols) * rank * min_compression_rate <
    rows * cols``. Vectors never pass it for a rate of 1 or more, so biases always travel uncompressed.
    """
    return (rows + cols) * rank * min_compression_rate < rows * cols


def square_side(numel: int) -> int:
    """Side of the smallest square holding ``numel`` elements (batched PowerSGD pads to it with zeros)."""
    side = math.isqrt(numel)
    return side if side * side == numel else side + 1


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Make the columns of each matrix in a ``(batch, rows, rank)`` tensor orthonormal, in place.

    Gram-Schmidt for rank <= 2 or half precision (QR has no half-precision kernel, and for one or two
    columns a few batched vector ops beat a LAPACK call); reduced Householder QR otherwise, which stays
    accurate when the columns are nearly dependent. ``epsilon`` is added to each column norm before
    dividing; with ``epsilon == 0`` an all-zero column stays zero instead of becoming NaN (torch's hook
    returns NaN there), and every other column is divided by its exact norm.
    """
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(
            f"orthogonalize_ expects a (batch, rows, rank) tensor with rank <= rows, got shape "
            f"{tuple(matrices.shape)}; cap the rank with effective_rank(rows, cols, rank)."
        )
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in _HALF:
        _gram_schmidt_(matrices, epsilon)
    else:
        q, _ = torch.linalg.qr(matrices, mode="reduced")
        matrices.copy_(q)
    return matrices


def _gram_schmidt_(matrices: torch.Tensor, epsilon: float) -> None:
    """Modified Gram-Schmidt over the columns of a batch of matrices, in place."""
    rank = matrices.shape[2]
    info = torch.finfo(matrices.dtype)
    smallest = info.tiny * info.eps  # the smallest subnormal: any nonzero norm is at least this
    for i in range(rank):
        column = matrices[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(column, dim=1, keepdim=True)
        if epsilon == 0:
            # Only a zero column has a norm below `smallest`; dividing it by `smallest` leaves it zero.
            norm.clamp_min_(smallest)
        else:
            norm.add_(epsilon)
        column.div_(norm)
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            projections = (column * rest).sum(dim=1, keepdim=True)  # (batch, 1, rank - i - 1)
            rest.addcmul_(column, projections, value=-1)


# Thin products with ``out=``: measured on this project's CPU (torch 2.13, 1 thread, 2048 x 2048 matrix),
# ``torch.mm(x.t(), p, out=q)`` with 2 or 4 columns takes ~35 ms where the same product computed as
# ``(p^T x)^T`` takes ~1.3-2.5 ms: the transposed operand sends it down a slow kernel. One column is a
# matrix-vector product, fast either way (~0.5 ms), and keeps torch's exact operation order.
#
# Two columns are the slow case of the matrix-matrix kernels (benchmarks/bench_powersgd_rank.py, 2048 x 2048,
# 1 thread): ``X Q`` took 3.2-4.0 ms at rank 2 against 2.3-2.6 ms at rank 4, and ``P Q^T`` 3.7 ms against
# 3.2 ms, which is why rank 2 used to be no faster than rank 4. Column by column (two matrix-vector
# products; one outer product and one rank-1 update) they take 2.5 ms and 2.0 ms.
def right_project_(p: torch.Tensor, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``p = x @ q`` for ``x`` (n, m) and thin ``q`` (m, r), written into ``p`` (n, r)."""
    rank = q.shape[1]
    if rank == 1:
        return torch.mm(x, q, out=p)
    if rank == 2:
        for j in range(2):
            torch.mv(x, q[:, j], out=p[:, j])
        return p
    return p.copy_(torch.mm(q.t(), x.t()).t())


def reconstruct_(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out = p @ q.T``, the rank-r approximation, for thin ``p`` (n, r) and ``q`` (m, r), into ``out`` (n, m)."""
    if q.shape[1] == 2:
        p0, p1, q0, q1 = (t.contiguous() for t in (p[:, 0], p[:, 1], q[:, 0], q[:, 1]))  # strided: 3x slower
        torch.outer(p0, q0, out=out)
        return out.addr_(p1, q1)
    return torch.mm(p, q.t(), out=out)


def left_project_(q: torch.Tensor, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``q = x.T @ p`` for ``x`` (n, m) and thin ``p`` (n, r), written into ``q`` (m, r)."""
    if p.shape[1] == 1:
        return torch.mm(x.t(), p, out=q)
    return q.copy_(torch.mm(p.t(), x).t())
