"""One rank of a two-rank job in which one rank is SIGKILLed during the shared-memory set-up, for
tests/engine/test_shared_memory.py.

Run as ``python -m tests.jobs.shm_peer_death_job VICTIM MODE`` in each rank's process (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE set). Rank VICTIM kills itself after rank 0 created the shared file and before both ranks
mapped it (rank 0: when it would map its own file; rank 1: when it would open rank 0's). MODE ``tmpfile``
runs the set-up as it is; ``named`` without ``O_TMPFILE``, as on a file system that lacks it (the file is
then created with a name and unlinked at once). Each rank prints ``pid <its pid>`` first; the survivor
then prints one JSON line: the type and message of the error the construction raised.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from lightning_ddpx import DistributedDataParallel
from lightning_ddpx.engine.agreement.errors import CommunicationError
from lightning_ddpx.engine.transport import shared_memory


def _die(*args: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    victim, mode = int(sys.argv[1]), sys.argv[2]
    print(f"pid {os.getpid()}", flush=True)
    if mode == "named":
        delattr(os, "O_TMPFILE")
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    if rank == victim:
        setattr(shared_memory, "_map_own" if rank == 0 else "_open_rank0_file", _die)
    try:
        DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    except Exception as error:  # noqa: BLE001 - the test checks which kind escaped
        kind = "CommunicationError" if isinstance(error, CommunicationError) else type(error).__name__
        print(json.dumps({"type": kind, "message": str(error)}), flush=True)
        return
    print(json.dumps({"type": None, "message": "construction finished"}), flush=True)


if __name__ == "__main__":
    main()
