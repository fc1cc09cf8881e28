"""What the launcher tells each training process, and the connection to the store it hosts.

The launcher (:mod:`lightning_ddpx.fault.launch`) hosts the run's ``TCPStore`` itself, outside every training
process, and starts each process with these variables. On several machines each machine's launcher points
its processes at the one store (``--store host:port``; docs/fault-tolerance.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

__all__ = ["ENV_VARIABLES", "LaunchInfo", "connect", "launch_info_from_environment"]

ENV_HOST, ENV_PORT, ENV_UID = "DDPX_FT_STORE_HOST", "DDPX_FT_STORE_PORT", "DDPX_FT_UID"
ENV_INITIAL, ENV_REPLACEMENT = "DDPX_FT_INITIAL_WORLD_SIZE", "DDPX_FT_REPLACEMENT"
ENV_VARIABLES = (ENV_HOST, ENV_PORT, ENV_UID, ENV_INITIAL, ENV_REPLACEMENT)


@dataclass(frozen=True)
class LaunchInfo:
    """Where the store is, who this process is, and how many processes the run starts with."""

    host: str
    port: int
    uid: str  # unique per process over the whole run, sortable (the launcher zero-pads it)
    initial_world_size: int
    replacement: bool = False


def launch_info_from_environment(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """The launcher's variables, or an error naming the missing one and how to start the run."""
    env = os.environ if environ is None else environ
    missing = [name for name in (ENV_HOST, ENV_PORT, ENV_UID, ENV_INITIAL) if not env.get(name)]
    if missing:
        raise RuntimeError(
            f"lightning_ddpx fault tolerance: {', '.join(missing)} not set: this process was not started by "
            "the fault-tolerant launcher. Start the run with `python -m lightning_ddpx.fault.launch --nproc N "
            "[--replacements K] -- train.py ...` (docs/fault-tolerance.md)."
        )
    return LaunchInfo(
        host=env[ENV_HOST],
        port=int(env[ENV_PORT]),
        uid=env[ENV_UID],
        initial_world_size=int(env[ENV_INITIAL]),
        replacement=env.get(ENV_REPLACEMENT, "0") == "1",
    )


def connect(info: LaunchInfo, timeout: timedelta) -> dist.TCPStore:
    """A client of the launcher's store (each thread that talks to it makes its own)."""
    return dist.TCPStore(info.host, info.port, is_master=False, timeout=timeout)
