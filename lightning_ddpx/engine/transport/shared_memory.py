"""Two CPU ranks on one machine: sum buckets through shared memory instead of gloo's TCP loopback.

gloo moves a bucket between two processes on the same host through the kernel's TCP stack: every byte is
copied into a socket and out of it again, on two cores that are also running backward. Here each rank
copies its bucket into its slot of one shared-memory file, a one-element all-reduce on the process group
says both slots are written, and each rank adds the other's slot to its own. What that gains (the
collective alone and whole training steps): docs/benchmarks.md, "Two CPU ranks on one machine".

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

Set-up, in two parts:

1. Whether every rank wants it. What only a rank itself knows (``DDPX_SHARED_MEMORY=0`` in its
   environment, no ``/dev/shm`` on its machine, parameters not on the CPU) is a few bits
   (:func:`local_obstacles`) that travel on the model check's all-gather at construction, which happens
   anyway: with shared memory off on every rank, construction issues no collective of its own for it, and
   ranks that disagree all see the disagreement, so none waits in a set-up the other skips. A module built
   without that check (``init_sync=False``, unpickled, a new group from ``use_process_group``) issues no
   collective at construction: its bits travel on the settings check before the first reduction, which
   every rank runs in step (:class:`~lightning_ddpx.engine.transport.transports.UndecidedDefault` says
   why). Only a reducer reducing without its module's check asks with one all-gather of one integer
   (:func:`gather_obstacles`).
2. :func:`open_exchange`, only when every rank wants it: rank 0 creates the file without a name
   (``O_TMPFILE``: it never appears in ``/dev/shm``; where the file system lacks it, a named file is
   unlinked right after it is created, before any collective), rank 1 opens it through
   ``/proc/<rank 0's pid>/fd/<fd>``, and one all-reduce says whether both mapped it. Whatever fails
   (a peer that dies, an exception, Ctrl-C), nothing is left in ``/dev/shm``: the memory goes when the
   last process holding it closes it or exits. Rank 0 refuses when the slots do not fit in ``/dev/shm``
   or in its memory cgroup (:mod:`lightning_ddpx.engine.transport.cgroup_memory`); rank 1 when the file is not
   there or holds another token (another machine, another PID namespace); then both use gloo.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from typing import Sequence

import torch
import torch.distributed as dist

from lightning_ddpx.engine.buckets.grad_bucket import GradBucket, payload_bytes, record_bytes_sent
from lightning_ddpx.engine.transport.cgroup_memory import cgroup_memory_room

__all__ = [
    "SharedMemoryExchange",
    "gather_obstacles",
    "local_obstacles",
    "obstacles_refusal",
    "open_exchange",
    "room_refusal",
]

# Each bucket's region starts on this boundary (any dtype's elements stay aligned).
_ALIGN = 64
_TOKEN_BYTES = 16
_DIRECTORY = "/dev/shm"
# Room left free in /dev/shm beyond the file, so that training never fills it.
_HEADROOM_BYTES = 64 * 1024 * 1024
ENV_SWITCH = "DDPX_SHARED_MEMORY"

# What keeps one rank out (bits of the integer each rank shares; 0: it can take part)
SWITCHED_OFF = 1
NOT_LINUX = 2
NOT_ON_CPU = 4


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


_TOKEN_BYTES_ALIGNED = _aligned(_TOKEN_BYTES)  # the slots start after the token


def region_bytes_bound(param_bytes: Sequence[int]) -> int:
    """Bytes one rank's slots need for any bucket layout of parameters of these sizes: every bucket holds
    whole parameters, so there are at most as many buckets (and alignment gaps) as parameters."""
    return _aligned(sum(param_bytes)) + _ALIGN * len(param_bytes)


# ------------------------------------------------------------------------ part 1: does every rank want it
def local_obstacles(params_on_cpu: bool) -> int:
    """What keeps this rank out, as bits only this rank knows (``DDPX_SHARED_MEMORY=0`` in its environment,
    no ``/dev/shm`` here, parameters elsewhere than on the CPU); 0 when it can take part."""
    switched_off = os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")
    linux = hasattr(os, "posix_fallocate") and os.path.isdir(_DIRECTORY) and os.path.isdir("/proc/self/fd")
    return (
        (SWITCHED_OFF if switched_off else 0)
        | (0 if linux else NOT_LINUX)
        | (0 if params_on_cpu else NOT_ON_CPU)
    )


def gather_obstacles(process_group: dist.ProcessGroup, mine: int) -> list[int]:
    """Collective (one all-gather of one integer): every rank's :func:`local_obstacles`, for a reducer built
    without the model check that otherwise carries them."""
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(gathered, torch.tensor([mine], dtype=torch.int64), group=process_group)
    return [int(value) for value in gathered]


def obstacles_refusal(obstacles: Sequence[int], rank: int) -> str | None:
    """Why this rank uses gloo given every rank's obstacles (the same decision on every rank); ``None``
    when every rank can take part."""
    reasons = []
    for other, bits in enumerate(obstacles):
        owner = "this rank's" if other == rank else f"rank {other}'s"
        if bits & SWITCHED_OFF:
            reasons.append(f"{ENV_SWITCH}=0 in {owner} environment")
        if bits & NOT_LINUX:
            reasons.append(f"no {_DIRECTORY} on {owner} machine (not Linux)")
        if bits & NOT_ON_CPU:
            reasons.append(f"{owner} parameters are not on the CPU")
    return "; ".join(reasons) if reasons else None


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


# ------------------------------------------------------------------------ part 2: map one file on both
def open_exchange(
    process_group: dist.ProcessGroup, param_bytes: Sequence[int]
) -> tuple[SharedMemoryExchange | None, str | None]:
    """Collective: map one unnamed shared file on both ranks of a two-rank gloo group, or on neither.

    Call on both ranks once every rank wants shared memory (:func:`obstacles_refusal` said ``None`` on
    both). Returns the exchange and ``None``, or ``None`` and why this rank falls back to gloo. A failing
    collective (a peer that died) raises the backend's error (the caller names what it waited for); the
    file has no name in ``/dev/shm`` by the time any collective starts, so nothing is left behind.
    """
    rank = dist.get_rank(process_group)
    world_size = dist.get_world_size(process_group)
    slot_bytes = region_bytes_bound(param_bytes)
    total = _TOKEN_BYTES_ALIGNED + 2 * world_size * slot_bytes
    fd: int | None = None  # rank 0's descriptor: open until rank 1 has opened the file through it
    mapping: mmap.mmap | None = None
    try:
        announced: list[object] = [None, None, None, None]  # rank 0's pid, descriptor, token; or why not
        if rank == 0:
            fd, token, refusal = _create(total)
            announced = [os.getpid(), fd, token, refusal]
        dist.broadcast_object_list(announced, group=process_group, group_src=0)
        pid, remote_fd, token, refusal = announced
        if refusal is not None:
            refusal = refusal if rank == 0 else f"rank 0: {refusal}"
        elif rank == 0:
            mapping, refusal = _map_own(fd, total)  # type: ignore[arg-type]
        else:
            mapping, refusal = _open_rank0_file(pid, remote_fd, token, total)  # type: ignore[arg-type]
        both = torch.tensor([1 if mapping is not None else 0], dtype=torch.int32)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=process_group)  # both mapped it, or neither uses it
    except BaseException:
        if mapping is not None:
            mapping.close()
        raise
    finally:
        if fd is not None:
            os.close(fd)  # the mappings keep the memory; it goes with the last of them
    if mapping is None:
        return None, str(refusal)
    if not both.item():
        mapping.close()
        return (
            None,
            "the other rank could not map the shared file (its reducer.shared_memory_refusal says why)",
        )
    storage = torch.frombuffer(mapping, dtype=torch.uint8)
    return SharedMemoryExchange(storage, mapping, rank, world_size, slot_bytes), None


def room_refusal(total: int, dev_shm_free: int, cgroup_room: int | None) -> str | None:
    """Why ``total`` bytes of slots do not fit, or ``None`` when they do (pure).

    ``/dev/shm`` keeps 64 MiB free beyond them. Their pages also count against the container's memory
    cgroup (``cgroup_room``: :func:`~lightning_ddpx.engine.transport.cgroup_memory.cgroup_memory_room`), and after
    construction training still allocates there (optimizer state, activations): the slots may take at
    most half of what the limit leaves.
    """
    mib = 2**20
    if dev_shm_free < total + _HEADROOM_BYTES:
        return (
            f"{_DIRECTORY} has {dev_shm_free / mib:.0f} MiB free; the slots need {total / mib:.0f} MiB plus "
            f"{_HEADROOM_BYTES / mib:.0f} MiB left free (Docker: --shm-size)"
        )
    if cgroup_room is not None and cgroup_room < total + max(total, _HEADROOM_BYTES):
        return (
            f"the container's memory limit (cgroup) leaves {cgroup_room / mib:.0f} MiB; the slots need "
            f"{total / mib:.0f} MiB and at least as much again left for training (Docker: --memory; "
            "Kubernetes: resources.limits.memory)"
        )
    return None


def _create(total: int) -> tuple[int | None, bytes | None, str | None]:
    """Rank 0: a new unnamed file of ``total`` bytes in /dev/shm, its pages reserved, a random token at its
    start, as an open descriptor; or ``None``s and why not."""
    try:
        stats = os.statvfs(_DIRECTORY)
    except OSError as error:
        return None, None, f"rank 0 cannot read {_DIRECTORY}: {error}"
    refusal = room_refusal(total, stats.f_bavail * stats.f_frsize, cgroup_memory_room())
    if refusal is not None:
        return None, None, refusal
    try:
        fd = _unnamed_file(_DIRECTORY)
    except OSError as error:
        return None, None, f"rank 0 could not create a file in {_DIRECTORY}: {error}"
    try:
        os.posix_fallocate(fd, 0, total)  # ENOSPC here, not a SIGBUS on first touch during training
        token = secrets.token_bytes(_TOKEN_BYTES)
        os.pwrite(fd, token, 0)
    except BaseException as error:
        os.close(fd)
        if isinstance(error, OSError):
            return None, None, f"rank 0 could not reserve {total / 2**20:.0f} MiB in {_DIRECTORY}: {error}"
        raise
    return fd, token, None


def _unnamed_file(directory: str) -> int:
    """A new empty file on ``directory``'s file system that has no name there: ``O_TMPFILE``, or where the
    file system lacks it a file unlinked right after it is created. Either way it disappears with the last
    descriptor or mapping of it, however the processes end."""
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    path = os.path.join(directory, f"lightning_ddpx_{os.getpid()}_{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_own(fd: int, total: int) -> tuple[mmap.mmap | None, str | None]:
    """Rank 0: map the file it created."""
    try:
        return mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), None
    except OSError as error:
        return None, f"rank 0 could not map {total / 2**20:.0f} MiB of {_DIRECTORY}: {error}"


def _open_rank0_file(pid: int, fd: int, token: bytes, total: int) -> tuple[mmap.mmap | None, str | None]:
    """Rank 1: map rank 0's file through its descriptor (``/proc/<pid>/fd/<fd>``), if it is that file (same
    machine, same PID namespace); otherwise ``None`` and why not."""
    path = f"/proc/{pid}/fd/{fd}"
    elsewhere = "the ranks run on different machines or in different PID namespaces (containers)"
    try:
        own = os.open(path, os.O_RDWR)
    except OSError as error:
        return None, (
            f"rank 0's shared file cannot be opened here as {path} ({error.strerror}): {elsewhere}, or "
            "/proc hides other processes (mounted with hidepid)"
        )
    try:
        if os.fstat(own).st_size != total:
            return None, f"{path} here is not rank 0's shared file (another size): {elsewhere}"
        mapping = mmap.mmap(own, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as error:
        return None, f"rank 1 could not map rank 0's shared file ({path}): {error}"
    finally:
        os.close(own)
    if mapping[:_TOKEN_BYTES] != token:
        mapping.close()
        return None, f"{path} here is not rank 0's shared file (another token): {elsewhere}"
    return mapping, None
