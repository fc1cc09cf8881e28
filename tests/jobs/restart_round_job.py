"""One worker of a torchrun round, for tests/lightning/test_restart_recipe.py: the default group created by
``lightning_ddpx.lightning.processes.restart_rendezvous.create_default_group`` on the store the test hosts (as torchrun's
agent does), then one all-reduce. ``python -m tests.jobs.restart_round_job die``: SIGKILL after the all-reduce, as a
killed round's worker that leaves its keys behind. Prints ``sum <value>`` (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_USE_AGENT_STORE set by the test)."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from lightning_ddpx.lightning.processes.restart_rendezvous import create_default_group


def main() -> None:
    assert create_default_group(TorchElasticEnvironment(), "gloo", timedelta(seconds=20))
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    print(f"sum {value.item():.0f}", flush=True)
    if sys.argv[1:] == ["die"]:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
