"""Fault tolerance across machines, emulated on 127.0.0.1: two launchers of tests/jobs/fault_job.py, node 0 hosting
the store with two processes, node 1 connecting to it (``--store``) with one, and node 1's process killed with
SIGKILL mid-backward. What it checks, from the logs the job writes after each committed step (the helpers of
tests/fault/test_fault_tolerance.py): node 0's processes go on and finish every step with the same parameters; node
1's launcher reports the loss; the survivors regroup without it.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.dist_utils import free_port, job_env, run_jobs
from tests.fault.test_fault_tolerance import STEPS, _logs, _pids, assert_consistent

pytestmark = pytest.mark.processes

LAUNCH = [sys.executable, "-m", "lightning_ddpx.fault.launch", "--world-size", "3"]


@pytest.mark.timeout(240)
def test_a_process_lost_on_another_machine_does_not_end_the_run(tmp_path):
    out = tmp_path / "logs"
    out.mkdir()
    port = free_port()
    job = ["--", "tests/jobs/fault_job.py", str(out), str(STEPS), "n1-00000:4:backward"]
    node0 = [*LAUNCH, "--nproc", "2", "--node-rank", "0", "--port", str(port), *job]
    node1 = [*LAUNCH, "--nproc", "1", "--node-rank", "1", "--store", f"127.0.0.1:{port}", *job]
    env = job_env(DDPX_SHARED_MEMORY="0")
    try:
        done0, done1 = run_jobs([(node0, env), (node1, env)], timeout=180)
    finally:
        for pid in _pids(out):  # nothing left behind, whatever happened
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    logs = _logs(out)
    assert done0.returncode == 0, done0.stderr[-3000:]
    survivors = ["n0-00000", "n0-00001"]
    assert_consistent(logs, survivors)
    # the three processes trained as one generation, ranks from the sorted uids, until the kill
    assert sorted(logs) == ["n0-00000", "n0-00001", "n1-00000"]
    assert {row[2] for rows in logs.values() for row in rows[:4]} == {3}
    assert [row[3] for row in logs["n1-00000"]] == [1, 2, 3, 4]
    # node 1's launcher saw its only process die (none of its processes finished: it returns 1) ...
    assert done1.returncode == 1, done1.stderr[-3000:]
    assert f"connected to the store at 127.0.0.1:{port}" in done1.stderr
    assert "process n1-00000 (pid " in done1.stderr and ") lost: killed by SIGKILL" in done1.stderr
    # ... and marked it in node 0's store: the survivors' next generation names it, and they finish as two
    assert "lost n1-00000: killed by SIGKILL" in done0.stderr
    assert {row[2] for uid in survivors for row in logs[uid][-3:]} == {2}
    assert f"--store <this machine's address>:{port}" in done0.stderr
