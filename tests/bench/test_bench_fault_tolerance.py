"""Keep benchmarks/bench_fault_tolerance.py from rotting: its ``--quick`` run, end to end.

Every path runs once with tiny sizes: a SIGKILL under the fault-tolerant launcher and the recipe's restart from
the checkpoint that run saved, a replacement healed, and the per-step comparison (whole runs, then blocks with
and without ``ft.step()`` in the same processes). Eleven process starts of torch on a small machine: slow.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.dist_utils import job_env, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.processes]


def test_the_quick_run_measures_every_figure(tmp_path) -> None:
    out = tmp_path / "fault_tolerance.json"
    script = os.path.join("benchmarks", "bench_fault_tolerance.py")
    done = run_job([sys.executable, script, "--quick", "--json", str(out)], timeout=400, env=job_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())

    recovery = results["recovery"]
    (repeat,) = recovery["repeats"]
    assert repeat["ours"]["world_after"] == 2  # the survivors' retried step, without the victim
    assert 0 < repeat["ours"]["kill_to_step_s"] < 120
    assert (
        repeat["recipe"]["restart_s"] > 0 and repeat["recipe"]["recompute_steps"] == 2
    )  # --checkpoint-every 4
    assert recovery["summary"]["ratio_recipe_over_ours"] > 0

    heal = results["heal"]
    assert heal["heal_s"] > 0 and heal["source"] == "00000"  # the lowest-ranked survivor (00001 was killed)
    assert heal["payload_mib"] >= 1.0  # the module's 1 MiB of parameters, and the rest of the state
    assert heal["start_to_first_step_s"] > 0 and all(v >= 0 for v in heal["phases_s"].values())

    overhead = results["overhead"]["summary"]
    assert overhead["plain_step_s"] > 0 and overhead["ft_step_s"] > 0
    assert overhead["interleaved_ratio"]["values"]  # one ratio per round
    assert 0 < overhead["last_voter_s"] <= overhead["vote_s"] + 1e-9
    assert overhead["store_round_trip_s"] > 0
    own = (overhead["boundary_s"] + overhead["vote_s"]) / overhead["plain_step_s"]
    assert overhead["own_code_share"] == pytest.approx(own)
    assert overhead["own_code_result"] in ("PASS", "MISS")
    for line in ("kill -> survivors' next completed step", "healed 00003 from", "goal ratio <= 1.01"):
        assert line in done.stdout
