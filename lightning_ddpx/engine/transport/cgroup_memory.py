"""How much memory this process's container may still take: its memory cgroup's limit minus its usage.

Pages of a ``/dev/shm`` file are charged to the memory cgroup of the process that touched them first, like
any other memory it allocates. A container whose ``/dev/shm`` is large (``--shm-size``, or the host's
``/dev/shm`` mounted in) but whose memory is limited would therefore be killed by the kernel's OOM killer
once training filled memory the free-space check of ``/dev/shm`` said was there. Docker and Kubernetes
set the limit in ``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (cgroup v1).

Usage counts reclaimable page cache too; like Kubernetes' "working set", the room here adds back the
inactive file cache (``inactive_file`` in ``memory.stat``), which the kernel drops before it kills.
"""

from __future__ import annotations

import os

__all__ = ["cgroup_memory_room"]

# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number; anything this large is no limit
_NO_LIMIT = 1 << 60


def cgroup_memory_room(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's memory cgroup can still be charged before it hits a limit: the smallest
    ``limit - (usage - inactive file cache)`` over its cgroup and the cgroups above it, in cgroup v2
    (``root/<path>/memory.max``) or v1 (``root/memory/<path>/memory.limit_in_bytes``). ``None`` when no
    limit is set or none can be read (not Linux, no cgroup file system mounted).

    Reads only the files under ``root`` and ``self_cgroup`` (tests point them at fake trees).
    """
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # cgroup v2
            rooms += _rooms_along(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1
            rooms += _rooms_along(
                os.path.join(root, "memory"),
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
    return min(rooms) if rooms else None


def _rooms_along(base: str, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[int]:
    """The room left under each limit from the process's cgroup up to ``base``. Inside a container the
    process's cgroup is often mounted as ``base`` itself (the path in /proc/self/cgroup is the host's):
    then only ``base`` is read."""
    parts = [part for part in path.strip("/").split("/") if part]
    if not os.path.isdir(os.path.join(base, *parts)):
        parts = []
    rooms = []
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(base, *parts[:depth])
        limit = _read_int(os.path.join(directory, limit_file))
        usage = _read_int(os.path.join(directory, usage_file))
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        inactive = _stat_value(os.path.join(directory, "memory.stat"), inactive_key)
        rooms.append(limit - max(0, usage - inactive))
    return rooms


def _read_int(path: str) -> int | None:
    """The integer in a cgroup file; ``None`` for ``max`` (cgroup v2: no limit) or a missing file."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0
