"""Two CPU ranks on one machine: sum buckets through shared memory instead of gloo's TCP loopback.

gloo moves a bucket between two processes on the same host through the kernel's TCP stack: every byte is
copied into a socket and out of it again, on two cores that are also running backward. Here each rank
copies its bucket into its slot of one shared-memory file, a one-element all-reduce on the process group
says both slots are written, and each rank adds the other's slot to its own: 0.32x the time of gloo's
all-reduce at 4-16.8 MB, 0.54x at 1 MB (``benchmarks/bench_collectives.py``, docs/benchmarks.md).

With two ranks every element is ``a + b`` on both sides (IEEE addition is commutative), so the result is
bit-identical to gloo's all-reduce and to torch's DDP. More ranks would sum in another order than gloo's
ring: not used there.

Safety of the slots without a second barrier: the file holds two generations, and the reducer switches
generation at the start of every reduction (real, or a joined rank's shadow: the ranks go through the
same sequence). A rank writes generation ``g`` again two reductions later, after the first barrier of the
reduction in between; the other rank reaches that barrier only after its end of backward waited for every
add it did from generation ``g``. So a slot is never overwritten while it is being read.

The reducer copies gradients straight into its slot when it can (:meth:`SharedMemoryExchange.own_slot`,
then :meth:`SharedMemoryExchange.sum_filled_hook`): one pass over the gradients instead of two.

Set-up is collective and falls back to gloo on every rank when any rank cannot take part: another
machine (the file rank 0 made is not there, or holds another token), too little room in ``/dev/shm``, or
``DDPX_SHARED_MEMORY=0`` on any rank. The file is unlinked as soon as every rank has mapped it, so a
crash leaves nothing behind.
"""

from __future__ import annotations

import mmap
import os
import secrets
from typing import Sequence

import torch
import torch.distributed as dist

from lightning_ddpx.engine.grad_bucket import GradBucket, payload_bytes, record_bytes_sent

__all__ = ["SharedMemoryExchange", "open_exchange"]

# Each bucket's region starts on this boundary (any dtype's elements stay aligned).
_ALIGN = 64
_TOKEN_BYTES = 16
_DIRECTORY = "/dev/shm"
# Room left free in /dev/shm beyond the file, so that training never fills it.
_HEADROOM_BYTES = 64 * 1024 * 1024
ENV_SWITCH = "DDPX_SHARED_MEMORY"


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


_TOKEN_BYTES_ALIGNED = _aligned(_TOKEN_BYTES)  # the slots start after the token


def region_bytes_bound(param_bytes: Sequence[int]) -> int:
    """Bytes one rank's slots need for any bucket layout of parameters of these sizes: every bucket holds
    whole parameters, so there are at most as many buckets (and alignment gaps) as parameters."""
    return _aligned(sum(param_bytes)) + _ALIGN * len(param_bytes)


class SharedMemoryExchange:
    """Both ranks' slots for every bucket, in two generations, in one shared mapping."""

    def __init__(
        self, storage: torch.Tensor, mapping: mmap.mmap, rank: int, world_size: int, slot_bytes: int
    ) -> None:
        self._mapping = mapping  # kept alive: ``storage`` points into it
        self._slots = storage[_TOKEN_BYTES_ALIGNED:].view(2, world_size, slot_bytes)
        self.rank = rank
        self._other = 1 - rank
        self._offsets: list[int] = []
        self._generation = 0

    def holds(self, param_bytes: Sequence[int]) -> bool:
        """Whether these slots hold every bucket layout of parameters of these sizes (the same answer on every
        rank: the slots were sized alike), so a new parameter set can keep them."""
        return region_bytes_bound(param_bytes) <= self._slots.shape[2]

    def set_layout(self, bucket_bytes: Sequence[int]) -> None:
        """Place the buckets of a new plan (every rank installs the same plan between iterations)."""
        offsets, offset = [], 0
        for nbytes in bucket_bytes:
            offsets.append(offset)
            offset += _aligned(nbytes)
        assert offset <= self._slots.shape[2], "region_bytes_bound holds every layout of whole parameters"
        self._offsets = offsets

    @property
    def generation(self) -> int:
        """Which of the two generations of slots the current reduction uses (0 or 1)."""
        return self._generation

    def next_generation(self) -> None:
        """A reduction starts (on every rank, in the same sequence): use the other generation's slots."""
        self._generation ^= 1

    def own_slot(self, b: int, like: torch.Tensor) -> torch.Tensor:
        """This rank's slot for bucket ``b`` in the current reduction, shaped and typed like ``like``."""
        return self._slot(self._generation, self.rank, b, like)

    def _slot(self, generation: int, rank: int, b: int, like: torch.Tensor) -> torch.Tensor:
        start = self._offsets[b]
        nbytes = payload_bytes(like)
        return self._slots[generation, rank, start : start + nbytes].view(like.dtype)

    def sum_hook(self, process_group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
        """The default path's hook: the bucket summed over both ranks, written back into its buffer."""
        self.own_slot(bucket.index(), bucket.buffer()).copy_(bucket.buffer())
        return self.sum_filled_hook(process_group, bucket)

    def sum_filled_hook(self, process_group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
        """:meth:`sum_hook` when the caller already wrote the bucket into :meth:`own_slot`: the sum goes to
        ``bucket.buffer()``."""
        b, buffer = bucket.index(), bucket.buffer()
        mine = self.own_slot(b, buffer)
        other = self._slot(self._generation, self._other, b, buffer)
        record_bytes_sent(bucket, payload_bytes(buffer))
        both_written = dist.all_reduce(torch.zeros(1), group=process_group, async_op=True).get_future()

        def add_other(future: torch.futures.Future) -> torch.Tensor:
            future.wait()  # raises the barrier's error, if any
            return self._add(mine, other, buffer)

        return both_written.then(add_other)

    @staticmethod
    def _add(mine: torch.Tensor, other: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Runs on gloo's thread once both slots are written (tests delay it to widen the race it must win)."""
        return torch.add(mine, other, out=out)


def open_exchange(
    process_group: dist.ProcessGroup, param_bytes: Sequence[int]
) -> tuple[SharedMemoryExchange | None, str | None]:
    """Collective: map one shared file on every rank, or on none if any rank cannot.

    Call on every rank of a two-rank gloo group whose parameters are on the CPU. Returns the exchange and
    ``None``, or ``None`` and why this rank falls back to gloo.
    """
    rank = dist.get_rank(process_group)
    world_size = dist.get_world_size(process_group)
    slot_bytes = region_bytes_bound(param_bytes)
    total = _TOKEN_BYTES_ALIGNED + 2 * world_size * slot_bytes
    wanted = os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")

    announced: list[object] = [None, None, f"{ENV_SWITCH}=0 on rank 0"]
    if rank == 0 and wanted:
        announced = list(_create(total))
    dist.broadcast_object_list(announced, group=process_group, group_src=0)
    path, token, refusal = announced
    mapped = None
    if not wanted:
        refusal = f"{ENV_SWITCH}=0 in this rank's environment"
    elif isinstance(path, str):
        mapped = _map(path, token, total)
        if mapped is None:
            refusal = f"the file rank 0 made ({path}) is not on this rank's machine"

    agreed = torch.tensor([1 if mapped is not None else 0], dtype=torch.int32)
    # every rank mapped it, or none uses it
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=process_group)
    dist.barrier(group=process_group)
    if rank == 0 and isinstance(path, str):
        os.unlink(path)  # the mappings keep the memory alive; nothing is left behind after exit
    if mapped is None:
        return None, str(refusal)
    if not agreed.item():
        return (
            None,
            "the other rank could not map the shared file (its reducer.shared_memory_refusal says why)",
        )
    storage, mapping = mapped
    return SharedMemoryExchange(storage, mapping, rank, world_size, slot_bytes), None


def _create(total: int) -> tuple[str | None, bytes | None, str | None]:
    """Rank 0: a new file of ``total`` bytes in /dev/shm, its pages reserved, a random token at its start;
    or ``None``s and why not."""
    if not (hasattr(os, "posix_fallocate") and os.path.isdir(_DIRECTORY)):
        return None, None, f"no {_DIRECTORY} here (not Linux)"
    try:
        free = os.statvfs(_DIRECTORY)
        available = free.f_bavail * free.f_frsize
        if available < total + _HEADROOM_BYTES:
            return (
                None,
                None,
                (
                    f"{_DIRECTORY} has {available / 2**20:.0f} MiB free; the slots need {total / 2**20:.0f} MiB plus "
                    f"{_HEADROOM_BYTES / 2**20:.0f} MiB left free (Docker: --shm-size)"
                ),
            )
        path = os.path.join(_DIRECTORY, f"lightning_ddpx_{os.getpid()}_{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        return None, None, f"rank 0 could not create a file in {_DIRECTORY}: {error}"
    try:
        os.posix_fallocate(fd, 0, total)  # ENOSPC here, not a SIGBUS on first touch during training
        token = secrets.token_bytes(_TOKEN_BYTES)
        os.pwrite(fd, token, 0)
    except OSError as error:
        os.close(fd)
        os.unlink(path)
        return None, None, f"rank 0 could not reserve {total / 2**20:.0f} MiB in {_DIRECTORY}: {error}"
    os.close(fd)
    return path, token, None


def _map(path: str, token: object, total: int) -> tuple[torch.Tensor, mmap.mmap] | None:
    """Map ``path`` if it is the file rank 0 made (same machine): ``None`` otherwise."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != total:
            return None
        mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None
    finally:
        os.close(fd)
    if mapping[:_TOKEN_BYTES] != token:
        mapping.close()
        return None
    return torch.frombuffer(mapping, dtype=torch.uint8), mapping
