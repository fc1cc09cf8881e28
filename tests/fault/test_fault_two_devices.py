"""Fault tolerance with the Trainer on two devices: a replacement joining a lone survivor heals and trains
(issue 46, item 6).

At world size 2 the default reducer path may be shared memory, which both ranks negotiate. The survivor
moves its module onto the new group before it sends the newcomer its state; the newcomer receives that
state before its module exists. A negotiation at either construction would therefore meet the other side's
state transfer, and each generation waited out the collective timeout forever. The tests run
tests/jobs/fault_trainer_job.py (its helpers are in tests/fault/test_fault_lightning.py) with ``devices=2``, kill one
process, and require the run to finish with one training on every member and no wait on a timeout.
"""

from __future__ import annotations

import pytest

from tests.fault.test_fault_lightning import assert_one_training, run_trainer_job

pytestmark = pytest.mark.processes

EPOCHS = 3  # 96 samples, batches of 4: 12 steps an epoch over 2 ranks, 24 over a lone survivor


@pytest.mark.slow
@pytest.mark.timeout(90)  # each takes ~15 s; the job's collective timeout is 20 s: a wait on it shows
@pytest.mark.parametrize("victim", ["00000", "00001"], ids=["rank0", "rank1"])
def test_two_devices_heal_a_replacement_of_either_rank_without_waiting_on_a_timeout(tmp_path, victim):
    _, main, logs, stderr = run_trainer_job(
        tmp_path,
        FAULT_JOB_DEVICES="2",
        FAULT_JOB_EPOCHS=str(EPOCHS),
        FAULT_JOB_KILL=f"{victim}:2:backward",
        DDPX_SHARED_MEMORY="1",  # the default: the path that two CPU ranks negotiate
    )
    assert f"process {victim}" in stderr and "killed by SIGKILL" in stderr
    assert "healed 00002" in stderr and "replicas verified" in stderr
    assert "Timed out" not in stderr and "did not arrive" not in stderr, stderr[-4000:]
    assert_one_training(logs, main, epochs=EPOCHS)
    assert "00002" in logs, "the replacement did not train"
    survivor = ({"00000", "00001"} - {victim}).pop()
    assert int(logs[survivor][-1][4]) == int(logs["00002"][-1][4]) == main["global_step"]
