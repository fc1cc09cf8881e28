"""The standard restart recipe under torchrun, with torchrun's store shared by every round (issue 51).

Since torch 2.5 torchrun's workers share the agent's TCP store and a killed round's keys outlive it: torch's
``env://`` creation of the default group then reads the dead round's gloo addresses (Connection refused, or a
wait in ``connectFullMesh`` until the group's timeout: pytorch/pytorch#135712).
:mod:`lightning_ddpx.lightning.processes.restart_rendezvous` creates the group on this round's keys only.

- The fast test runs two rounds of two workers on one store the test hosts, as torchrun's agent does: the
  first round's workers create the group and die by SIGKILL, leaving their keys; the second round's connect.
- The slow test runs the user's recipe (tests/jobs/restart_recipe_job.py: ``strategy="ddpx"``, ``last.ckpt`` every
  epoch, rank 1 SIGKILLed in epoch 3, ``--max-restarts=1``, no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``) for
  ``RESTART_RECIPE_RUNS`` runs (3; a longer loop: set it higher), each exact against the uninterrupted run,
  none hung, nothing left in ``/dev/shm``, no worker left running.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import REPO_ROOT, job_env, run_jobs

pytestmark = pytest.mark.processes

RECIPE = str(REPO_ROOT / "tests" / "jobs" / "restart_recipe_job.py")
RUNS = int(os.environ.get("RESTART_RECIPE_RUNS", "3"))
RUN_TIMEOUT_S = 120  # a run takes 10-25 s here; gloo's connect would wait the group's 30 minutes


def round_env(port: int, restart: int, rank: int) -> dict[str, str]:
    return job_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID="test",
        TORCHELASTIC_RESTART_COUNT=str(restart),
        TORCHELASTIC_USE_AGENT_STORE="True",
        PYTHONWARNINGS="ignore",
    )


@pytest.mark.timeout(120)
def test_a_restarted_round_on_the_shared_store_connects_past_the_killed_rounds_keys():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's, kept
    command = [sys.executable, "-m", "tests.jobs.restart_round_job"]
    killed = run_jobs([([*command, "die"], round_env(store.port, 0, rank)) for rank in (0, 1)], timeout=60)
    assert [job.returncode for job in killed] == [-signal.SIGKILL] * 2, [job.stderr[-2000:] for job in killed]
    assert all("sum 3" in job.stdout for job in killed)
    assert store.num_keys() > 1, "the killed round left no keys: the test would prove nothing"
    restarted = run_jobs([(command, round_env(store.port, 1, rank)) for rank in (0, 1)], timeout=60)
    for job in restarted:
        assert job.returncode == 0 and "sum 3" in job.stdout, job.stderr[-3000:]


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (torchrun starts its workers in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def torchrun_recipe(workdir: Path, kill_epoch: int) -> tuple[object, str]:
    """One run of the recipe: its return code (``"hung"`` after RUN_TIMEOUT_S) and its output."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        RECIPE,
        "--workdir",
        str(workdir),
        "--kill-epoch",
        str(kill_epoch),
    ]
    env = job_env(PYTHONWARNINGS="ignore")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's default: one store for every round
    workdir.mkdir(parents=True)
    with open(workdir / "log.txt", "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: object = process.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = "hung"
        finally:
            workers = _descendants(process.pid)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # torchrun stops its workers
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            for pid in [process.pid, *workers]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
    return code, (workdir / "log.txt").read_text(errors="replace")


def _strategy_creates_the_round_group() -> bool:
    from lightning_ddpx import DDPXStrategy

    return "create_default_group" in inspect.getsource(DDPXStrategy.setup_distributed)


@pytest.mark.slow
@pytest.mark.timeout(60 + RUNS * (RUN_TIMEOUT_S + 20))
@pytest.mark.skipif(
    not _strategy_creates_the_round_group(),
    reason="DDPXStrategy.setup_distributed does not call restart_rendezvous.create_default_group yet",
)
def test_the_restart_recipe_recovers_exactly_every_time(tmp_path):
    code, log = torchrun_recipe(tmp_path / "reference", -1)
    assert code == 0, log[-4000:]
    reference = torch.load(tmp_path / "reference" / "final-attempt0.pt", weights_only=True)
    outcomes = []
    for run in range(RUNS):
        before = set(os.listdir("/dev/shm"))
        started = time.monotonic()
        code, log = torchrun_recipe(tmp_path / f"run{run}", 3)
        left = sorted(set(os.listdir("/dev/shm")) - before)
        final = tmp_path / f"run{run}" / "final-attempt1.pt"
        exact = final.exists() and (
            (got := torch.load(final, weights_only=True))["global_step"] == reference["global_step"]
            and all(torch.equal(got["parameters"][k], v) for k, v in reference["parameters"].items())
        )
        outcomes.append((run, code, exact, left, round(time.monotonic() - started)))
        assert code == 0 and exact and not left, (outcomes, log[-4000:])
