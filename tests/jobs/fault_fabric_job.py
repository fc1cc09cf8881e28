"""A fault-tolerant Lightning Fabric job for the tests: ``Fabric(devices=3, strategy=DDPXStrategy(fault_tolerance=...))``.

    python tests/jobs/fault_fabric_job.py OUT_DIR STEPS

``fabric.launch()`` in the process started supervises three training processes (and exits with their exit
code). Each trains with data keyed on (committed step, rank, world size) and appends, after every committed
step, ``uid pid generation world_size step digest`` to ``OUT_DIR/<uid>.log``. ``FAULT_JOB_KILL=uid:step``
makes training process ``uid`` SIGKILL itself mid-backward at that committed step. ``FAULT_JOB_HOOK=diloco``:
DiLoCo with an outer step every 5 inner steps; ``post_local_sgd``: 4 steps of global averaging, then an
average every 5 local steps.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy
from tests.jobs.fault_job import batch, digest


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    kill_uid, kill_step = (os.environ.get("FAULT_JOB_KILL", "") + "::").split(":")[:2]
    hook = os.environ.get("FAULT_JOB_HOOK") or None  # "diloco": an outer step every 5 inner steps
    strategy = DDPXStrategy(
        fault_tolerance={"replacements": 1, "heartbeat_timeout_s": 5.0, "collective_timeout_s": 20.0},
        comm_hook=hook,
        diloco={"period": 5} if hook == "diloco" else None,
        post_local_sgd={"start_localSGD_iter": 4, "period": 5, "subgroup": 1}
        if hook == "post_local_sgd"
        else None,
    )
    fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy)
    fabric.launch()
    uid = os.environ["DDPX_FT_UID"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    ft = fabric.strategy.fault_manager

    def die_in_backward(grad: torch.Tensor) -> torch.Tensor:
        if uid == kill_uid and ft.steps_committed == int(kill_step):
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model.module[0].weight.register_hook(die_in_backward)
    while ft.steps_committed < steps:
        with ft.step() as step:
            optimizer.zero_grad()
            x, y = batch(ft.steps_committed, ft.rank, ft.world_size)
            fabric.backward(nn.functional.mse_loss(model(x), y))
        if step.committed:
            optimizer.step()  # with DiLoCo, Fabric's strategy then runs the outer step when due, fault-tolerantly
            with open(os.path.join(out, f"{uid}.log"), "a") as log:
                log.write(
                    f"{uid} {os.getpid()} {ft.generation.number} {ft.world_size} {ft.steps_committed} "
                    f"{digest(model.module)}\n"
                )
            if ft.world_size < 3:
                time.sleep(0.4)  # time for the replacement to start and register
    # written by the membership's rank 0, with the membership and the hook's shared state (DiLoCo's)
    fabric.save(os.path.join(out, "final.ckpt"), {"model": model, "optimizer": optimizer})
    fabric.strategy.teardown()


if __name__ == "__main__":
    main()
