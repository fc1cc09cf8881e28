"""One rank of a bare-module job whose last act is a collective, for tests/lightning/test_process_exit.py.

Run as ``python -m tests.jobs.bare_exit_job`` in each rank's process (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
set). It trains our DistributedDataParallel a few steps, all-reduces a temporary tensor, destroys the group
while the model -- as in any user's script -- still references it, and exits: the moment at which gloo's
worker threads may still be releasing that collective (lightning_ddpx/engine/exit_threads.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddpx import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    dist.all_reduce(torch.ones(10))
    dist.destroy_process_group()  # `model` still holds the group: gloo's workers live on


if __name__ == "__main__":
    main()
