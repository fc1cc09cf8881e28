"""A rank killed mid-training under torchrun: the job restarts, resumes from ``last.ckpt`` with the PowerSGD
state, and ends with the parameters of a run that was never interrupted, bit for bit.

Both runs are real ``python -m torch.distributed.run --standalone --nproc-per-node 2`` jobs of
examples/torchrun_resume.py (4 epochs of 8 steps per rank, PowerSGD compressing from step 2, a checkpoint
at every epoch end). In the first, rank 1 SIGKILLs itself in epoch 2 (batch 3) of its first attempt and
torchrun (``--max-restarts 1``) starts both ranks again; the reference run has no kill.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: since torch 2.5 torchrun's workers share the agent's TCPStore, and
keys of the killed attempt survive in it; the restarted process group can then read the dead rank's gloo
address and fail to connect, or hang (pytorch/pytorch#135712; on torch 2.13 here, 3 of 3 restarts failed
without it). With the variable set, every attempt bootstraps a fresh store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_ddpx.lightning.checkpoints.checkpoint_io import TEMP_PREFIX
from tests.dist_utils import REPO_ROOT, job_env, run_job

pytestmark = [pytest.mark.slow, pytest.mark.processes]

EPOCH_STEPS = 8  # 64 samples / 2 ranks / batch 4
EPOCHS = 4
KILL_EPOCH = 2


def torchrun(workdir: str, kill_epoch: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # rendezvous on a free local port
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        os.path.join(REPO_ROOT, "examples", "torchrun_resume.py"),
        "--workdir",
        workdir,
        "--epochs",
        str(EPOCHS),
        "--kill-epoch",
        str(kill_epoch),
    ]
    env = job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONWARNINGS="ignore")
    result = run_job(command, timeout=300, env=env)
    assert result.returncode == 0, (
        f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    return result


def records(workdir: str) -> dict[tuple[int, int], dict]:
    """(attempt, rank) -> what that process recorded when its training started."""
    found = {}
    for name in os.listdir(workdir):
        if name.endswith(".json"):
            with open(os.path.join(workdir, name)) as file:
                record = json.load(file)
            found[record["attempt"], record["rank"]] = record
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    interrupted = str(tmp_path_factory.mktemp("interrupted"))
    reference = str(tmp_path_factory.mktemp("reference"))
    torchrun(interrupted, KILL_EPOCH)
    torchrun(reference, -1)
    return {"interrupted": interrupted, "reference": reference}


def test_a_rank_was_killed_and_torchrun_restarted_both(runs):
    found = records(runs["interrupted"])
    assert sorted(found) == [(0, 0), (0, 1), (1, 0), (1, 1)], "two attempts of two ranks"
    for rank in (0, 1):
        assert found[0, rank]["resumed_from"] is None and found[0, rank]["global_step"] == 0
    assert sorted(records(runs["reference"])) == [(0, 0), (0, 1)], "the reference ran once"


def test_the_restart_resumed_from_the_last_epoch_end_with_powersgd_state(runs):
    found = records(runs["interrupted"])
    for rank in (0, 1):
        record = found[1, rank]
        assert record["resumed_from"].endswith(os.path.join("checkpoints", "last.ckpt"))
        assert record["epoch"] == KILL_EPOCH and record["global_step"] == KILL_EPOCH * EPOCH_STEPS
        # A fresh PowerSGD state would start at iteration 0 (and compress only from step 2 again).
        assert record["powersgd_iter"] == KILL_EPOCH * EPOCH_STEPS


def test_restarted_run_ends_with_the_parameters_of_an_uninterrupted_run(runs):
    interrupted = torch.load(os.path.join(runs["interrupted"], "final.pt"), weights_only=True)
    reference = torch.load(os.path.join(runs["reference"], "final.pt"), weights_only=True)
    assert interrupted["attempt"] == 1 and reference["attempt"] == 0
    assert interrupted["global_step"] == reference["global_step"] == EPOCHS * EPOCH_STEPS
    assert interrupted["powersgd_iter"] == reference["powersgd_iter"] == EPOCHS * EPOCH_STEPS
    assert interrupted["parameters"].keys() == reference["parameters"].keys()
    for name, expected in reference["parameters"].items():
        assert torch.equal(interrupted["parameters"][name], expected), name


def test_checkpoints_of_the_interrupted_run_are_whole_and_safe(runs):
    directory = os.path.join(runs["interrupted"], "checkpoints")
    names = sorted(os.listdir(directory))
    assert names == [f"epoch={epoch}.ckpt" for epoch in range(EPOCHS)] + ["last.ckpt"]
    assert not [name for name in names if name.startswith(TEMP_PREFIX)]
    for name in names:
        entry = torch.load(os.path.join(directory, name), weights_only=True)["lightning_ddpx"]
        assert entry["hook"] == "powersgd" and len(entry["per_rank"]) == 2
