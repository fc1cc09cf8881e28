"""Turn a failed or timed-out collective into an error that says what was being waited for and what to do.

gloo and NCCL report a dead or stalled peer as "Connection closed by peer" or "Timed out waiting ...";
that says nothing about which step of training was in progress. Every collective the engine waits on
runs inside :func:`waiting_for`, which re-raises with the thing being waited for, this rank, and the
process-group timeout with how to change it.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Callable, Iterator, Union

import torch.distributed as dist

from lightning_ddpx._compat.torch import group_timeout
from lightning_ddpx.engine.agreement.progress_board import peer_report

__all__ = [
    "CommunicationError",
    "as_communication_error",
    "describe_failure",
    "is_communication_failure",
    "waiting_for",
]


class CommunicationError(RuntimeError):
    """A collective issued by lightning_ddpx failed: usually a peer rank died, stalled or diverged."""


def process_group_timeout(process_group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout after which a collective on ``process_group`` fails, where torch exposes it."""
    try:
        group = process_group if process_group is not None else dist.group.WORLD
        return group_timeout(group)
    except Exception:  # noqa: BLE001 - best effort: backends differ in what they expose
        return None


def describe_failure(what: str, process_group: dist.ProcessGroup | None, error: BaseException) -> str:
    timeout = process_group_timeout(process_group)
    limit = f"{timeout.total_seconds():.0f} s" if timeout is not None else "the process group's timeout"
    rank = dist.get_rank() if dist.is_initialized() else "?"
    peer = _peer_description(process_group)
    text = str(error)
    if "Timed out" in text or "timed out" in text or "timeout" in text.lower():
        cause = f"no peer answered within {limit}: {peer} stalled, skipped a backward, is much slower, or the network between ranks is down"
    elif "closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        cause = f"{peer} exited or crashed (check its log for the first error)"
    else:
        cause = "the collective failed"
    peers = peer_report(process_group)
    return (
        f"lightning_ddpx (rank {rank}): {cause} while waiting for {what}. "
        + (f"{peers} " if peers else "")
        + f"Collectives time out after {limit}; to wait longer pass timeout=datetime.timedelta(...) to "
        f"init_process_group or to DDPXStrategy. Underlying error: {text}"
    )


def _peer_description(process_group: dist.ProcessGroup | None) -> str:
    """Which peer failed, as far as this rank can tell without communicating: in a group of two, the other."""
    try:
        group = process_group if process_group is not None else dist.group.WORLD
        if dist.get_world_size(group) == 2:
            other = 1 - dist.get_rank(group)
            return f"the other rank (rank {dist.get_global_rank(group, other)})"
    except Exception:  # noqa: BLE001 - best effort: the group may already be gone
        pass
    return "another rank"


@contextlib.contextmanager
def waiting_for(
    what: Union[str, Callable[[], str]], process_group: dist.ProcessGroup | None
) -> Iterator[None]:
    """Re-raise a failing collective inside as :class:`CommunicationError` naming ``what`` (a string, or a
    function making it, for hot paths that should not build the text unless something fails)."""
    try:
        yield
    except RuntimeError as error:
        failure = as_communication_error(error, what, process_group)
        if failure is not None:
            raise failure from error
        raise


def as_communication_error(
    error: BaseException, what: Union[str, Callable[[], str]], process_group: dist.ProcessGroup | None
) -> CommunicationError | None:
    """:func:`waiting_for`'s rule, for a hot path that catches the error itself (a ``with`` block costs a
    generator per use): ``error``, a failed collective, as :class:`CommunicationError` naming ``what``
    (raise it ``from error``); ``None`` if ``error`` is one already or no failed collective."""
    if isinstance(error, CommunicationError) or not isinstance(error, RuntimeError):
        return None
    if not _looks_like_communication_failure(error):
        return None
    return CommunicationError(describe_failure(what() if callable(what) else what, process_group, error))


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective: ours (:class:`CommunicationError`), torch's
    ``DistError``, or a backend's ``RuntimeError`` that says so (a closed peer, a timeout). What fault
    tolerance votes on, and counts as a lost peer rather than an error of the training code."""
    if isinstance(error, (CommunicationError, dist.DistError)):
        return True
    return isinstance(error, RuntimeError) and _looks_like_communication_failure(error)


def _looks_like_communication_failure(error: RuntimeError) -> bool:
    text = str(error)
    return any(
        marker in text
        for marker in (
            "gloo",
            "Timed out",
            "timed out",
            "closed by peer",
            "Connection reset",
            "NCCL",
            "Broken pipe",
            "timeout caused pair closure",  # gloo, when the peer's link went down (no packets, no reset)
        )
    )
