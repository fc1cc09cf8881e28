"""``DDPX_DEBUG=1``: before each bucket is handed to its hook, check that every rank reduces the same one.

Like ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: the ranks all-gather (synchronising forwards so far, iteration,
bucket, size, dtype) and raise :class:`CollectiveMismatchError` on every rank, naming the first rank and
bucket that differ, instead of pairing the wrong collectives or hanging. One small all-gather per bucket:
for debugging only.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import CommunicationError
from lightning_ddpx.engine.agreement.progress_board import DEBUG_ENV

T = TypeVar("T")

__all__ = ["CollectiveMismatchError", "bucket_checked", "check_same_sequence", "checked_call", "dtype_code"]


class CollectiveMismatchError(CommunicationError):
    """``DDPX_DEBUG=1`` found ranks about to reduce different buckets (a skipped or extra backward)."""


class BucketShape(Protocol):
    """What the check compares of a bucket (a :class:`~lightning_ddpx.engine.buckets.plan.BucketSpec`)."""

    numel: int
    dtype: torch.dtype
    device: torch.device


_DTYPE_CODES = {
    dtype: code
    for code, dtype in enumerate(
        (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
    )
}
_FIELDS = ("synchronising forwards", "iteration", "bucket", "elements", "dtype code")


def check_same_sequence(
    process_group: dist.ProcessGroup, device: torch.device, signature: Sequence[int], where: str
) -> None:
    """All-gather ``signature`` (see ``_FIELDS``); raise on every rank if any rank's differs from rank 0's."""
    world_size = dist.get_world_size(process_group)
    mine = torch.tensor(list(signature), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=process_group)
    rows = [g.tolist() for g in gathered]
    bad = next((r for r in range(world_size) if _differs(rows[r], rows[0])), None)
    if bad is None:
        return
    field = next(
        i for i in range(len(_FIELDS)) if rows[bad][i] != rows[0][i] and min(rows[bad][i], rows[0][i]) >= 0
    )
    per_rank = "; ".join(
        f"rank {r}: " + ", ".join(f"{name} {value}" for name, value in zip(_FIELDS, row))
        for r, row in enumerate(rows)
    )
    raise CollectiveMismatchError(
        f"lightning_ddpx ({DEBUG_ENV}=1, checking {where}): rank {bad} is about to reduce bucket {rows[bad][2]} "
        f"with {_FIELDS[field]} {rows[bad][field]}, but rank 0 reduces bucket {rows[0][2]} with {rows[0][field]}. "
        f"Per rank: {per_rank}. A rank skipped a backward or ran an extra synchronising forward (e.g. a "
        "data-dependent branch or an early 'continue'), or ranks built different models; make every rank run "
        "the same forward/backward sequence, or run the extra ones inside no_sync()."
    )


def _differs(row: list[int], reference: list[int]) -> bool:
    """-1 is a wildcard: a rank shadowing inside ``join()`` has no forward or iteration count of its own."""
    return any(a != b and a >= 0 and b >= 0 for a, b in zip(row, reference))


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, 99)


def checked_call(
    call: Callable[[], T],
    process_group: dist.ProcessGroup,
    device: torch.device,
    signature: Sequence[int],
    what: str,
) -> Callable[[], T]:
    """``call`` preceded by :func:`check_same_sequence` of ``signature`` (DDPX_DEBUG): every rank must be
    about to do the same thing, ``what``."""

    def checked() -> T:
        check_same_sequence(process_group, device, signature, what)
        return call()

    return checked


def bucket_checked(
    call: Callable[[], T],
    process_group: dist.ProcessGroup,
    b: int,
    spec: BucketShape,
    counters: tuple[int, int],
) -> Callable[[], T]:
    """``call`` (bucket ``b``'s reduction) preceded by DDPX_DEBUG's check that every rank reduces this same
    bucket now; ``counters``: the synchronising forwards and reductions counted at this point."""
    signature = (*counters, b, spec.numel, dtype_code(spec.dtype))
    return checked_call(call, process_group, spec.device, signature, f"bucket {b} before its hook")
