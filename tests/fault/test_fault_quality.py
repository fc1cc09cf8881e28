"""The fault-quality benchmark in small: a 3-rank digits run that loses rank 0 mid-backward and heals ends where the
uninterrupted run does (``benchmarks/bench_fault_quality.py --quick``: 1 seed, 40 steps, the kill at step 16).

The tolerance is the issue's goal, 2 %. In a correct run the two differ by rounding only: the retried step and
those after it compute the same global batch's mean gradient over two ranks instead of three (same samples,
other summation order). Measured with these settings on seed 0, the gap was 0 and 5e-8 in two runs, and a
run on two ranks throughout differed from the three-rank one by 0.007 % after 30 steps: 2 % leaves a margin
of 100x over rounding. A broken retry lands well outside it (measured with these settings, four steps on two
ranks): the survivors keeping their old shares, the lost rank's third of the batch dropped, gave +5.4 %; the
discarded step's samples skipped instead of retried gave +32 %.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.dist_utils import REPO_ROOT, job_env, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400), pytest.mark.processes]

GAP_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory) -> dict:
    """One uninterrupted run and one per victim (rank 0, the middle rank), shared by the tests below."""
    out = tmp_path_factory.mktemp("quality") / "fault_quality.json"
    argv = [sys.executable, "benchmarks/bench_fault_quality.py", "--quick", "--victims", "rank0,middle"]
    done = run_job([*argv, "--json", str(out), "--timeout", "150"], timeout=380, env=job_env(), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_run_that_loses_rank_0_and_heals_ends_within_2_percent_of_the_uninterrupted_run(quick_runs):
    saved = quick_runs
    base, killed = saved["runs"]["0"]["uninterrupted"], saved["runs"]["0"]["rank0"]

    # the interrupted run really lost rank 0 and healed its replacement: the launcher's and the members' lines
    log = "\n".join(killed["fault_tolerance_log"])
    assert "process 00000" in log and "lost: killed by SIGKILL" in log, log
    assert "started process 00003" in log, log
    assert re.search(r"healed 00003 from 00001 .*replicas verified", log), log
    assert killed["ended_on"] == ["00001", "00002", "00003"] and killed["replicas_equal_at_end"], killed[
        "ended_on"
    ]
    assert killed["stats"]["members_lost"] == 1 and killed["stats"]["newcomers_healed"] == 1, killed["stats"]
    # ... and the uninterrupted one did not
    assert not any(word in line for line in base["fault_tolerance_log"] for word in ("lost:", "healed")), base

    gap = killed["final_val_loss"] / base["final_val_loss"] - 1
    assert abs(gap) <= GAP_TOLERANCE, (base["curve"], killed["curve"])
    assert saved["summary"]["victims"]["rank0"]["gap_goal_met"]
    assert base["final_val_loss"] < 1.5  # trained: chance is ln 10 = 2.30


def test_no_survivor_waits_out_the_collective_timeout_when_the_middle_rank_is_lost(quick_runs):
    # In a ring all-reduce one survivor fails at once and the other waits on it; before failed members closed
    # their connections, that one waited the whole collective timeout (10 s in the job) in 5 of 6 runs.
    killed = quick_runs["runs"]["0"]["middle"]
    log = "\n".join(killed["fault_tolerance_log"])
    assert "lost: killed by SIGKILL" in log and "discarded on every member" in log, log
    assert "no peer answered" not in log, log
