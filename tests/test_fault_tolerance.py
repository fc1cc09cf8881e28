"""Fault tolerance across real processes: the launcher, three gloo ranks of tests/fault_job.py, and a process
killed with SIGKILL (or a failure injected) at a chosen point of a chosen step.

What every test checks, from the per-process logs the job writes after each committed step:
- the survivors went on in the same processes (one pid per log, every step up to the last);
- every process that logged a step logged the same parameter digest for it: no member applied a step the
  others discarded, and a newcomer was healed to the survivors' bits;
- the launcher's and the members' messages name the lost process and the discarded step.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.dist_utils import job_env, run_job

pytestmark = pytest.mark.timeout(240)

STEPS = 12
LAUNCH = [sys.executable, "-m", "lightning_ddpx.fault.launch", "--nproc", "3"]


def run_fault_job(
    tmp_path: Path,
    kill: str = "",
    replacements: int = 0,
    steps: int = STEPS,
    pause_s: float = 0.0,
    hook: str = "",
):
    out = tmp_path / "logs"
    out.mkdir()
    argv = [*LAUNCH, "--replacements", str(replacements), "--", "tests/fault_job.py", str(out), str(steps)]
    env = job_env(FAULT_JOB_PAUSE_S=str(pause_s), DDPX_SHARED_MEMORY="0", FAULT_JOB_HOOK=hook)
    try:
        done = run_job(argv + ([kill] if kill else []), timeout=180, env=env)
    finally:
        pids = _pids(out)
        for pid in pids:  # nothing left behind, whatever happened
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    return done, _logs(out)


def _logs(out: Path) -> dict[str, list[tuple[int, int, int, int, str]]]:
    """uid -> [(pid, generation, world size, step, digest)] in the order written."""
    logs = {}
    for path in sorted(out.glob("*.log")):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        logs[path.stem] = [(int(r[1]), int(r[2]), int(r[3]), int(r[4]), r[5]) for r in rows]
    return logs


def _pids(out: Path) -> set[int]:
    return {row[0] for rows in _logs(out).values() for row in rows} if out.exists() else set()


def assert_consistent(logs, survivors, steps=STEPS):
    """Every step's digest is the same in every log; survivors ran every step in one process."""
    digests = defaultdict(set)
    for rows in logs.values():
        for _, _, _, step, digest in rows:
            digests[step].add(digest)
    different = {step: sorted(d) for step, d in digests.items() if len(d) > 1}
    assert not different, f"members applied different parameters at steps {different}"
    for uid in survivors:
        rows = logs[uid]
        assert [row[3] for row in rows] == list(range(1, steps + 1)), f"{uid} skipped or repeated a step"
        assert len({row[0] for row in rows}) == 1, f"{uid} was restarted"


def test_a_failure_injected_at_one_step_discards_it_on_every_member_and_nobody_is_lost(tmp_path):
    done, logs = run_fault_job(tmp_path, kill="00001:5:raise")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00000", "00001", "00002"])
    assert done.stderr.count("step 5 discarded on every member of generation 1") == 3
    assert "injected failure in process 00001" in done.stderr
    # the same three members go on in generation 2: nobody lost, nobody healed
    assert {row[1] for row in logs["00000"][5:]} == {2} and {row[2] for row in logs["00000"]} == {3}
    assert "healed" not in done.stderr


@pytest.mark.parametrize(
    ("victim", "point"),
    [("00000", "backward"), ("00001", "forward"), ("00002", "optimizer"), ("00001", "boundary")],
    ids=["rank0-mid-backward", "middle-forward", "last-after-commit", "middle-at-boundary"],
)
def test_a_killed_member_does_not_end_the_run(tmp_path, victim, point):
    done, logs = run_fault_job(tmp_path, kill=f"{victim}:4:{point}")
    assert done.returncode == 0, done.stderr[-3000:]
    survivors = [uid for uid in ("00000", "00001", "00002") if uid != victim]
    assert_consistent(logs, survivors)
    # it logged the steps before the one it died in (after a commit: before applying that step, which the
    # survivors applied: every member had voted for it)
    assert [row[3] for row in logs[victim]] == ([1, 2, 3] if point == "optimizer" else [1, 2, 3, 4])
    assert f"process {victim}" in done.stderr and "killed by SIGKILL" in done.stderr
    assert f"lost {victim}: killed by SIGKILL" in done.stderr  # the generation that leaves it out says so
    # the survivors finish as a generation of two
    assert {row[2] for uid in survivors for row in logs[uid][-3:]} == {2}


def test_a_replacement_heals_from_a_live_peer_after_rank_0_is_killed(tmp_path):
    done, logs = run_fault_job(tmp_path, kill="00000:3:backward", replacements=1, steps=24, pause_s=0.25)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00001", "00002"], steps=24)
    assert "started process 00003" in done.stderr
    newcomer = logs["00003"]  # healed to the survivors' bits (checked above), then trained with them
    assert newcomer and newcomer[-1][3] == 24 and {row[2] for row in newcomer} == {3}
    assert "healed 00003 from 00001" in done.stderr and "replicas verified" in done.stderr


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_a_stateless_hook_follows_the_new_membership(tmp_path, hook):
    done, logs = run_fault_job(
        tmp_path, kill="00002:3:backward", replacements=1, steps=16, pause_s=0.25, hook=hook
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00000", "00001"], steps=16)
    assert "healed 00003 from 00000" in done.stderr and logs["00003"][-1][3] == 16


REFUSALS = """
import torch
from torch import nn
from lightning_ddpx.fault import FaultTolerance

ft = FaultTolerance()
for name in ("powersgd", "post_local_sgd", "diloco"):
    try:
        ft.wrap(nn.Linear(2, 2), comm_hook=name)
    except ValueError as error:
        print("refused:", error)
model = ft.wrap(nn.Linear(2, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model.overlap_optimizer_with(optimizer)
try:
    with ft.step():
        pass
except ValueError as error:
    print("refused:", error)
ft.close()
"""


def test_what_cannot_survive_a_membership_change_is_refused_by_name_before_the_first_step(tmp_path):
    script = tmp_path / "refusals.py"
    script.write_text(REFUSALS)
    done = run_job([*LAUNCH[:-1], "1", "--", str(script)], timeout=120, env=job_env())
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("powersgd", "post_local_sgd", "diloco"):
        assert f"refused: lightning_ddpx fault tolerance: comm_hook {name!r} is not supported" in done.stdout
    assert "the supported hooks are ['allreduce', 'bf16', 'fp16', 'noop']" in done.stdout
    assert "refused: lightning_ddpx fault tolerance: the optimizer overlap" in done.stdout
