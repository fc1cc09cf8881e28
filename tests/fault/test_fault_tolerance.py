"""Fault tolerance across real processes: the launcher, three gloo ranks of tests/jobs/fault_job.py, and a process
killed with SIGKILL (or a failure injected) at a chosen point of a chosen step.

What every test checks, from the per-process logs the job writes after each committed step:
- the survivors went on in the same processes (one pid per log, every step up to the last);
- every process that logged a step logged the same parameter digest for it: no member applied a step the
  others discarded, and a newcomer was healed to the survivors' bits;
- the launcher's and the members' messages name the lost process and the discarded step.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.dist_utils import job_env, run_job

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]

STEPS = 12
POWERSGD = {"powersgd": {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}}
LAUNCH = [sys.executable, "-m", "lightning_ddpx.fault.launch", "--nproc", "3"]


def run_fault_job(
    tmp_path: Path,
    kill: str = "",
    replacements: int = 0,
    steps: int = STEPS,
    hook: str = "",
    nproc: int = 3,
    logs: str = "logs",
    **extra_env: str,
):
    out = tmp_path / logs
    out.mkdir()
    launch = [*LAUNCH[:-1], str(nproc), "--replacements", str(replacements)]
    argv = [*launch, "--", "tests/jobs/fault_job.py", str(out), str(steps)]
    env = job_env(DDPX_SHARED_MEMORY="0", FAULT_JOB_HOOK=hook, **extra_env)
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
    ("hook", "options"),
    [("", {}), ("batched_powersgd", POWERSGD)],  # the failure raised in the reducer / inside a hook
    ids=["allreduce", "batched_powersgd"],
)
def test_a_collective_that_fails_on_one_member_only_discards_the_step_on_every_member(
    tmp_path, hook, options
):
    """Process 00001's second all-reduce of step 4 (a bucket's, mid-backward; PowerSGD compressing since
    step 2) fails on it alone after it was issued. Without a hook it is the step's last: the others'
    collectives all succeed, and they would apply the step. The vote makes every member discard it; the same three members retry it in a new group, and every parameter (and
    PowerSGD's shared state) is equal on every process after every step."""
    done, logs = run_fault_job(
        tmp_path,
        kill="00001:4:collective",
        hook=hook,
        FAULT_JOB_DDP_OPTIONS=json.dumps(options),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "injected failure at an all-reduce of process 00001 at step 4" in done.stderr
    # the others discard it too
    assert done.stderr.count("step 4 discarded on every member of generation 1 (injected failure") == 1
    assert done.stderr.count("step 4 discarded on every member of generation 1") == 3
    if hook == "":  # the step's last all-reduce: the others' reductions all succeed, the vote says abort
        assert done.stderr.count("generation 1 (another member's collectives failed") == 2
    else:  # bucket 0's second phase: the failing member issues nothing after it, so the others' bucket 1 fails
        assert done.stderr.count("another rank exited or crashed (check its log for the first error) while "
                                 "waiting for bucket 1") == 2  # fmt: skip
    assert_consistent(logs, ["00000", "00001", "00002"])
    assert {row[2] for row in logs["00000"]} == {3} and "healed" not in done.stderr  # nobody lost
    if options:
        assert_same_hook_state(tmp_path / "logs", STEPS)


def test_a_local_error_between_two_collectives_of_a_hook_costs_only_its_own_process(tmp_path):
    """Process 00001 raises inside batched PowerSGD's hook instead of issuing the second all-reduce of step 4
    (an error of its own, not a communication failure: it propagates, and the process ends). It must issue
    no later bucket's collective either: the others are still in the one it skipped, and would pair it with
    the wrong one (gloo aborted a peer with SIGABRT before). The two others discard step 4 and go on."""
    done, logs = run_fault_job(
        tmp_path, kill="00001:4:unissued", hook="batched_powersgd", FAULT_JOB_DDP_OPTIONS=json.dumps(POWERSGD)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "injected local error before an all-reduce of process 00001 at step 4" in done.stderr
    assert "process 00001" in done.stderr and "lost: exit code 1" in done.stderr
    assert "SIGABRT" not in done.stderr and done.stderr.count(" lost: ") == 1
    assert done.stderr.count("step 4 discarded on every member of generation 1") == 2
    assert_consistent(logs, ["00000", "00002"])
    assert [row[3] for row in logs["00001"]] == [1, 2, 3, 4][: len(logs["00001"])]
    assert {row[2] for row in logs["00000"][4:]} == {2}


def test_a_collective_between_steps_failing_on_one_member_is_run_again_by_every_member(tmp_path):
    """A loop that takes one batch per attempt from its own counter (as over a data loader) and all-reduces a
    rank-dependent metric between steps. After step 4 that all-reduce fails on process 00001 alone (the
    others' succeeded): the vote on it makes every member regroup at once and run it again, so every member
    gets the same value, no batch is skipped, and each committed step trained the same batch everywhere."""
    done, _ = run_fault_job(tmp_path, kill="00001:4:between", FAULT_JOB_OWN_BATCHES="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "injected failure between steps in process 00001" in done.stderr
    assert done.stderr.count("every member regroups now and runs it again") == 3
    assert "discarded" not in done.stderr and "no peer answered" not in done.stderr
    batches = {
        path.stem: [tuple(line.split()) for line in path.read_text().splitlines()]
        for path in sorted((tmp_path / "logs").glob("*.batches"))
    }
    assert set(batches) == {"00000", "00001", "00002"}
    assert batches["00000"] == batches["00001"] == batches["00002"], "members trained or reduced apart"
    assert [int(b) for _, b, _ in batches["00000"]] == list(range(STEPS))  # no batch skipped
    assert {float(m) for _, _, m in batches["00000"]} == {6.0}  # 1 + 2 + 3: over every member, each time


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


def test_a_silent_member_is_left_behind_after_the_timeouts_chosen_and_stopped(tmp_path):
    # stopped mid-backward: its connections stay open, so the survivors' collective fails only after
    # collective_timeout_s (3 s), and it is lost once its heartbeat has not moved for heartbeat_timeout_s (2 s)
    done, logs = run_fault_job(
        tmp_path,
        kill="00001:4:stall",
        steps=STEPS,
        FAULT_JOB_COLLECTIVE_S="3",
        FAULT_JOB_HEARTBEAT_S="2",
        FAULT_JOB_STALL_S="10",
    )
    assert done.returncode == 0, done.stderr[-3000:]  # the survivors finished
    assert_consistent(logs, ["00000", "00002"])
    assert "no peer answered within 3 s" in done.stderr
    assert "lost 00001: no heartbeat for" in done.stderr
    # once the others formed a generation without it, its launcher stops it (were it resumed first, it would
    # learn that it was left out and stop: tests/fault/test_fault_membership.py)
    assert "was left behind by the others (no heartbeat for" in done.stderr
    assert [row[3] for row in logs["00001"]] == [1, 2, 3, 4]


def test_a_member_alive_but_stuck_before_its_vote_is_left_behind_after_the_timeouts_chosen(tmp_path):
    """00001 finishes its backward at step 4 and then hangs, alive (its heartbeat moves), never voting: the
    others abort the step after collective_timeout_s (3 s), leave it behind once it has not come back within
    join_timeout_s (4 s), and finish as a generation of two."""
    done, logs = run_fault_job(
        tmp_path, kill="00001:4:hang", FAULT_JOB_COLLECTIVE_S="3", FAULT_JOB_JOIN_S="4"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00000", "00002"])
    assert "lost 00001: did not come back within join_timeout_s=4 s" in done.stderr
    assert "was left behind by the others (did not come back" in done.stderr  # its launcher stopped it
    assert [row[3] for row in logs["00001"]] == [1, 2, 3, 4]
    assert {row[2] for uid in ("00000", "00002") for row in logs[uid][-3:]} == {2}


def test_a_replacement_heals_from_a_live_peer_after_rank_0_is_killed(tmp_path):
    done, logs = run_fault_job(
        tmp_path, kill="00000:3:backward", replacements=1, steps=24, FAULT_JOB_FULL_WORLD="3"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00001", "00002"], steps=24)
    assert "started process 00003" in done.stderr
    newcomer = logs["00003"]  # healed to the survivors' bits (checked above), then trained with them
    assert newcomer and newcomer[-1][3] == 24 and {row[2] for row in newcomer} == {3}
    assert "healed 00003 from 00001" in done.stderr and "replicas verified" in done.stderr
    # what a logger gets, per member: the membership now, the failures so far, what they cost
    metrics = {
        path.name.split(".")[0]: json.loads(path.read_text())
        for path in (tmp_path / "logs").glob("*.metrics.json")
    }
    assert set(metrics) == {"00001", "00002", "00003"}
    survivor = metrics["00001"]
    assert survivor["fault_tolerance/world_size"] == 3 and survivor["fault_tolerance/generation"] == 3
    assert survivor["fault_tolerance/failures"] == 1 and survivor["fault_tolerance/members_lost"] == 1
    assert survivor["fault_tolerance/newcomers_healed"] == 1
    assert (
        0 < survivor["fault_tolerance/last_recovery_s"] < 5
        and 0 < survivor["fault_tolerance/last_heal_s"] < 5
    )


@pytest.mark.parametrize("options", [{"static_graph": True}, {"find_unused_parameters": True}], ids=str)
def test_the_modules_options_follow_the_new_membership(tmp_path, options):
    # a new reducer per generation: static_graph records again, the used-parameter bitmap over the new group
    done, logs = run_fault_job(
        tmp_path,
        kill="00001:3:backward",
        replacements=1,
        steps=16,
        FAULT_JOB_FULL_WORLD="3",
        FAULT_JOB_DDP_OPTIONS=json.dumps(options),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00000", "00002"], steps=16)
    assert "healed 00003 from 00000" in done.stderr and logs["00003"][-1][3] == 16


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_a_stateless_hook_follows_the_new_membership(tmp_path, hook):
    done, logs = run_fault_job(
        tmp_path,
        kill="00002:3:backward",
        replacements=1,
        steps=16,
        hook=hook,
        FAULT_JOB_FULL_WORLD="3",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00000", "00001"], steps=16)
    assert "healed 00003 from 00000" in done.stderr and logs["00003"][-1][3] == 16


def _hook_logs(out: Path) -> dict[str, list[tuple[int, int, str]]]:
    return {
        path.stem: [(int(step), int(iteration), digest) for step, iteration, digest in map(str.split, lines)]
        for path in sorted(out.glob("*.hook"))
        for lines in [path.read_text().splitlines()]
    }


def assert_same_hook_state(out: Path, steps: int) -> None:
    """PowerSGD's shared state (iteration, seed generator, warm-start Q) equal on every process at every
    step, and its iteration one per committed step: no discarded step moved it, a newcomer got it."""
    by_step: dict[int, set[tuple[int, str]]] = defaultdict(set)
    for rows in _hook_logs(out).values():
        for step, iteration, digest in rows:
            by_step[step].add((iteration, digest))
    assert sorted(by_step) == list(range(1, steps + 1))
    for step, found in by_step.items():
        assert len(found) == 1, f"PowerSGD's shared state differs between members after step {step}: {found}"
        assert next(iter(found))[0] == step


@pytest.mark.parametrize(
    ("hook", "wrapper"),
    [("powersgd", None), ("batched_powersgd", None), ("powersgd", "bf16")],
    ids=["powersgd", "batched_powersgd", "powersgd-in-bf16-wrapper"],
)
def test_powersgd_follows_the_new_membership_and_a_newcomer_gets_its_shared_state(tmp_path, hook, wrapper):
    options = {**POWERSGD, "comm_wrapper": wrapper} if wrapper else POWERSGD
    done, logs = run_fault_job(
        tmp_path,
        kill="00002:4:backward",  # compressing since step 2: buckets of the failed step were compressed
        replacements=1,
        steps=16,
        hook=hook,
        FAULT_JOB_FULL_WORLD="3",
        FAULT_JOB_DDP_OPTIONS=json.dumps(options),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00000", "00001"], steps=16)
    assert "healed 00003 from 00000" in done.stderr and logs["00003"][-1][3] == 16
    assert_same_hook_state(tmp_path / "logs", 16)


def test_a_discarded_powersgd_step_is_rolled_back_on_every_member(tmp_path):
    done, logs = run_fault_job(
        tmp_path, kill="00001:5:raise", hook="powersgd", FAULT_JOB_DDP_OPTIONS=json.dumps(POWERSGD)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00000", "00001", "00002"])
    assert done.stderr.count("step 5 discarded on every member of generation 1") == 3
    assert_same_hook_state(tmp_path / "logs", STEPS)


DILOCO = {"diloco": {"period": 4}}


def assert_averaged_consistent(logs, survivors, synced_at, steps=16):
    """DiLoCo, post-local SGD: the replicas train apart between averages (their digests differ there) and
    are equal after each one (``synced_at(step)``), the newcomer's included; survivors ran every step in one
    process."""
    digests = defaultdict(set)
    for rows in logs.values():
        for _, _, _, step, digest in rows:
            digests[step].add(digest)
    synced = {step: sorted(d) for step, d in digests.items() if synced_at(step) and len(d) > 1}
    assert not synced, f"replicas differ after the averages {synced}"
    assert any(len(d) > 1 for step, d in digests.items() if not synced_at(step)), "the steps were not local"
    for uid in survivors:
        rows = logs[uid]
        assert [row[3] for row in rows] == list(range(1, steps + 1)), f"{uid} skipped or repeated a step"
        assert len({row[0] for row in rows}) == 1, f"{uid} was restarted"


def run_averaging_job(tmp_path, kill, survivors, hook, options, synced_at, averaged_at, failed_average):
    """A kill and a heal with a hook that averages parameters: the replicas equal where ``synced_at(step)``
    and apart elsewhere, the newcomer's first step right after an average (``averaged_at``), and for a kill
    just before an average (``sync``), the survivors' ``failed_average`` put back and run again."""
    done, logs = run_fault_job(
        tmp_path,
        kill=kill,
        replacements=1,
        steps=16,
        hook=hook,
        FAULT_JOB_FULL_WORLD="3",
        FAULT_JOB_DDP_OPTIONS=json.dumps(options),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_averaged_consistent(logs, survivors, synced_at)
    newcomer = logs["00003"]
    assert averaged_at(newcomer[0][3] - 1) and newcomer[-1][3] == 16, "the newcomer joined between averages"
    assert f"healed 00003 from {survivors[0]}" in done.stderr
    if "sync" in kill:  # the survivors' average failed, was put back and run again among the two
        assert f"{failed_average} failed on generation 1" in done.stderr
        assert "every member put its parameters back" in done.stderr


@pytest.mark.parametrize(
    ("kill", "survivors"),
    [("00001:5:backward", ["00000", "00002"]), ("00000:8:sync", ["00001", "00002"])],
    ids=["middle-mid-period", "rank0-before-the-outer-step"],
)
def test_diloco_loses_only_the_lost_replicas_inner_steps_and_heals_after_an_outer_step(
    tmp_path, kill, survivors
):
    run_averaging_job(
        tmp_path,
        kill,
        survivors,
        "diloco",
        DILOCO,
        lambda step: step % 4 == 0,  # equal after each outer step ...
        lambda step: step % 4 == 0,  # ... where the newcomer joins
        "DiLoCo's outer step after step 8",
    )


def test_sparse_diloco_puts_back_its_error_buffers_reruns_a_failed_outer_step_and_heals(tmp_path):
    """The sparse exchange: rank 0 is killed right before the outer step after step 8; the survivors put
    back their parameters and error buffers (each rank's own, in the snapshot), run the exchange again
    between the two of them, and stay bit-identical after every outer step; the replacement, admitted
    right after an outer step with its error buffers at zero, too."""
    run_averaging_job(
        tmp_path,
        "00000:8:sync",
        ["00001", "00002"],
        "diloco",
        {"diloco": {"period": 4, "sparse": {"density": 0.1, "bits": 2, "chunk": 64}}},
        lambda step: step % 4 == 0,
        lambda step: step % 4 == 0,
        "DiLoCo's outer step after step 8",
    )


def test_streaming_diloco_reruns_a_failed_fragment_sync_and_heals_a_copy_of_a_live_replica(tmp_path):
    """Two fragments, each sent every 4 steps (fragment 0 after steps 2, 6, 10, 14; fragment 1 after 4, 8,
    12, 16), applied a step later (overlap_steps=1) and mixed with the local values (mixing 0.5): the
    replicas never all agree, the anchors always do. Rank 0 is killed right before fragment 0's exchange
    after step 6; the survivors put it back and run it again, and the replacement, admitted right after an
    exchange or an application, is healed as a copy of the lowest-ranked live replica (proved bit-identical
    to it; the anchors and the means waiting to be applied proved identical on every member)."""
    done, logs = run_fault_job(
        tmp_path,
        kill="00000:6:sync",
        replacements=1,
        steps=16,
        hook="diloco",
        FAULT_JOB_FULL_WORLD="3",
        FAULT_JOB_DDP_OPTIONS=json.dumps(
            {"diloco": {"period": 4, "fragments": 2, "mixing": 0.5, "overlap_steps": 1}}
        ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DiLoCo's outer step after step 6 failed on generation 1" in done.stderr
    assert "healed 00003 from 00001" in done.stderr and "replicas verified" in done.stderr
    assert_same_hook_state(tmp_path / "logs", 16)  # anchors equal everywhere, one inner step per commit
    digests = defaultdict(set)
    for rows in logs.values():
        for _, _, _, step, digest in rows:
            digests[step].add(digest)
    assert all(len(found) > 1 for step, found in digests.items() if step > 1), "the replicas were equal"
    for uid in ("00001", "00002"):
        assert [row[3] for row in logs[uid]] == list(range(1, 17)) and len({r[0] for r in logs[uid]}) == 1
    newcomer = logs["00003"]
    assert newcomer[0][3] - 1 >= 6 and newcomer[-1][3] == 16  # joined after the survivors' rerun exchange
    assert "overlap_steps=1: each exchange completes within the step that sends it" in done.stderr


# global averaging for 4 steps, then local steps with an average after steps 5, 9, 13
POST_LOCAL_SGD = {"post_local_sgd": {"start_localSGD_iter": 4, "period": 4, "subgroup": 1}}


@pytest.mark.parametrize(
    ("kill", "survivors"),
    [("00001:7:backward", ["00000", "00002"]), ("00000:9:sync", ["00001", "00002"])],
    ids=["middle-between-averages", "rank0-before-an-average"],
)
def test_post_local_sgd_loses_only_the_lost_replicas_local_steps_and_heals_after_an_average(
    tmp_path, kill, survivors
):
    run_averaging_job(
        tmp_path,
        kill,
        survivors,
        "post_local_sgd",
        POST_LOCAL_SGD,
        lambda step: step <= 5 or (step - 1) % 4 == 0,  # equal in the warm-up and after each average ...
        lambda step: step >= 5 and (step - 1) % 4 == 0,  # ... where the newcomer joins
        "post-local SGD's model averaging after step 9",
    )


def test_post_local_sgd_by_machine_finds_each_memberships_machines_again(tmp_path):
    """``subgroup=None`` (torch's default: the ranks on each machine) is found again for every membership.
    On this one machine that is every rank, so gradients stay averaged over all of them and the replicas
    are equal at every step, before and after the middle process is killed and a replacement is healed."""
    done, logs = run_fault_job(
        tmp_path,
        kill="00001:7:backward",
        replacements=1,
        steps=16,
        hook="post_local_sgd",
        FAULT_JOB_FULL_WORLD="3",
        FAULT_JOB_DDP_OPTIONS=json.dumps({"post_local_sgd": {"start_localSGD_iter": 4, "period": 4}}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(logs, ["00000", "00002"], steps=16)
    assert "healed 00003 from 00000" in done.stderr and logs["00003"][-1][3] == 16


REFUSALS = """
import torch
from torch import nn
from lightning_ddpx.fault import FaultTolerance

ft = FaultTolerance()
for options in ({"subgroup": 2, "period": 4}, {"subgroup": 1}):  # a subgroup of 2; averaging by hand
    try:
        ft.wrap(nn.Linear(2, 2), comm_hook="post_local_sgd", post_local_sgd=options)
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
try:
    with model.join():  # uneven inputs (refused first: before the model's options are looked at)
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
    assert (
        "refused: lightning_ddpx fault tolerance: post-local SGD with subgroup=2 is not supported"
        in done.stdout
    )
    assert (
        "refused: lightning_ddpx fault tolerance: post-local SGD with period=None is not supported"
        in done.stdout
    )
    assert (
        "refused: lightning_ddpx fault tolerance: model.join() (uneven inputs) is not supported"
        in done.stdout
    )
    assert "refused: lightning_ddpx fault tolerance: the optimizer overlap" in done.stdout


def test_checkpoints_survive_their_writer_killed_mid_save_and_resume_at_another_world_size(tmp_path):
    checkpoint = tmp_path / "run.ckpt"
    saving = {"FAULT_JOB_CHECKPOINT": str(checkpoint), "FAULT_JOB_CHECKPOINT_EVERY": "4"}
    # rank 0 writes; it is killed inside its save at step 8, after the step was applied everywhere
    done, first = run_fault_job(tmp_path, kill="00000:8:save", **saving)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_consistent(first, ["00001", "00002"])
    assert [row[3] for row in first["00000"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    # the survivors' new rank 0 (00001) wrote step 12's checkpoint and removed the killed writer's partial file
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run.ckpt")) == ["run.ckpt"]
    # a new run of two processes resumes from it: step 12's bits, then steps 13-16 at world size 2
    done, second = run_fault_job(tmp_path, steps=16, nproc=2, logs="resumed", FAULT_JOB_RESUME="1", **saving)
    assert done.returncode == 0, done.stderr[-3000:]
    step_12 = first["00001"][11][4]
    assert (tmp_path / "resumed" / "00000.resumed").read_text().split() == ["12", step_12]
    assert "resumed from" in done.stderr and "saved by a generation of 2 rank(s); now 2" in done.stderr
    for uid in ("00000", "00001"):
        assert [row[3] for row in second[uid]] == [13, 14, 15, 16]
    assert second["00000"][-1][4] == second["00001"][-1][4]


def _module_seams(rank: int, world_size: int) -> dict:
    """The module's two seams for fault tolerance, on a real group: how long a failing rank waits for the
    others' reports (kept across a new reducer), and a released group refused by name until a new one."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_ddpx import DistributedDataParallel

    model = DistributedDataParallel(nn.Linear(2, 2))
    seen = {"default": model.reducer.progress.final_grace_s}
    model.failure_report_wait_s = 0
    seen["set"] = model.reducer.progress.final_grace_s
    for wrong in (-1, True, "0"):
        try:
            model.failure_report_wait_s = wrong
        except (TypeError, ValueError) as error:
            seen.setdefault("refused", []).append(f"{type(error).__name__}: {error}")
    seen["released_before"] = model.released
    model.release_process_group()
    seen["released_state"] = model.released
    try:
        _ = model.reducer
    except RuntimeError as error:
        seen["released"] = str(error)
    model.use_process_group(dist.new_group(list(range(world_size))))
    seen["released_after"] = model.released
    seen["after_new_group"] = model.reducer.progress.final_grace_s
    model(torch.ones(1, 2)).sum().backward()  # it reduces on the new group
    model.close()
    return seen


def test_the_modules_fault_tolerance_seams_keep_their_settings_and_refuse_a_released_group():
    from tests.dist_utils import run_distributed

    seen = run_distributed(_module_seams, 2)[0]
    assert seen["default"] == 1.0 and seen["set"] == 0.0 and seen["after_new_group"] == 0.0
    negative, a_bool, text = seen["refused"]
    assert negative.startswith("ValueError") and "failure_report_wait_s must be seconds >= 0" in negative
    assert a_bool.startswith("TypeError") and text.startswith("TypeError") and "a number of seconds" in text
    assert "released its process group" in seen["released"] and "use_process_group()" in seen["released"]
    assert (seen["released_before"], seen["released_state"], seen["released_after"]) == (False, True, False)
