"""Fault tolerance through the Lightning strategies: ``Trainer(devices=3, strategy=DDPXStrategy(fault_tolerance=...))``.

The process-level tests run tests/jobs/fault_trainer_job.py as a user would (``python script.py``): the process
started supervises, three training processes train, one is SIGKILLed at a chosen point of a chosen step, a
replacement is started and admitted at the next epoch's start. What they check:
- ``fit`` returned in the process the user started, with the weights the training processes ended with;
- the survivors went on in the same processes (one pid per log), and every process that applied a step
  applied the same one (one parameter digest per global step over every log);
- the replacement joined at an epoch's first batch, healed to the survivors' bits;
- the loggers got the membership (one logger version, written by whichever process was rank 0).

The fast tests check the option itself: what it refuses, by name, before any process starts.
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.dist_utils import free_port, job_env, run_job, run_jobs

JOB = "tests/jobs/fault_trainer_job.py"
EPOCHS, STEPS_PER_EPOCH = 4, 8  # 96 samples, batches of 4, over 3 ranks


def run_trainer_job(tmp_path: Path, **env: str):
    out = tmp_path / "out"
    out.mkdir(parents=True)
    done = run_job(
        [sys.executable, JOB, str(out)],
        timeout=200,
        env=job_env(
            **{
                "PYTHONWARNINGS": "ignore",
                "DDPX_SHARED_MEMORY": "0",
                "FAULT_JOB_EPOCHS": str(EPOCHS),
                **env,
            }
        ),
    )
    assert done.returncode == 0, f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}"
    logs = {}
    for path in sorted(out.glob("0*.log")):
        logs[path.stem] = [line.split() for line in path.read_text().splitlines()]
    return out, json.loads((out / "main.json").read_text()), logs, done.stderr


def expected_steps(logs: dict, accumulate: int = 1) -> int:
    """The global steps a run takes: each epoch's batch count is fixed at its start, over the members
    present then (96 samples, batches of 4), so an epoch that starts after a loss and before the heal runs
    over the survivors' reshard (12 batches on two), and one in which a member is lost keeps its count."""
    first: dict[int, tuple[int, int]] = {}
    for lines in logs.values():
        for line in lines:
            epoch, batch, world_size = int(line[5]), int(line[6]), int(line[3])
            if epoch not in first or batch < first[epoch][0]:
                first[epoch] = (batch, world_size)
    return sum(96 // world_size // 4 // accumulate for _, world_size in first.values())


def assert_one_training(
    logs: dict, main: dict, epochs: int = EPOCHS, accumulate: int = 1, total_steps: int | None = None
) -> None:
    digests: dict[int, set[tuple[str, str]]] = defaultdict(set)
    for uid, lines in logs.items():
        assert len({line[1] for line in lines}) == 1, (
            f"{uid} was restarted: {sorted({line[1] for line in lines})}"
        )
        for _, _, _, _, step, _, _, digest, hook in lines:
            digests[int(step)].add((digest, hook))  # parameters and PowerSGD's shared state
    split = {step: found for step, found in digests.items() if len(found) > 1}
    assert not split, f"members applied different updates at global steps {split}"
    expected = total_steps if total_steps is not None else expected_steps(logs, accumulate)
    assert len({int(line[5]) for lines in logs.values() for line in lines}) == epochs
    assert main["global_step"] == expected, (main["global_step"], expected)
    assert main["digest"] == digests[max(digests)].pop()[0], (
        "fit() returned other weights than the training ended with"
    )


@pytest.mark.slow
@pytest.mark.timeout(260)
@pytest.mark.parametrize(
    ("kills", "hook"),
    [
        # rank 0 twice in one run: 00000 in backward; then 00001, rank 0 since, inside a checkpoint save
        ("00000:2:backward,00001:26:save", ""),
        ("00001:2:forward", "fp16"),
        ("00002:2:optimizer", "powersgd"),
    ],
    ids=["rank0-backward-then-rank0-checkpoint-save", "middle-forward-fp16", "last-optimizer-powersgd"],
)
@pytest.mark.processes
def test_a_trainer_survives_killed_processes_and_heals_a_replacement_for_each(tmp_path, kills, hook):
    victims = {uid: int(step) for uid, step, _ in (kill.split(":") for kill in kills.split(","))}
    # a loss and its replacement's heal at the next epoch's start take an epoch each
    epochs = EPOCHS + len(victims) - 1
    out, main, logs, stderr = run_trainer_job(
        tmp_path,
        FAULT_JOB_KILL=kills,
        FAULT_JOB_HOOK=hook,
        FAULT_JOB_REPLACEMENTS=str(len(victims)),
        FAULT_JOB_EPOCHS=str(epochs),
    )
    assert_one_training(logs, main, epochs=epochs)
    replacements = [f"{3 + i:05d}" for i in range(len(victims))]
    for uid in replacements:
        assert uid in logs, f"no replacement {uid} trained"
        assert logs[uid][0][6] == "0", f"the replacement joined mid-epoch: {logs[uid][0]}"
        assert f"healed {uid}" in stderr
    for uid, step in victims.items():
        assert int(logs[uid][-1][4]) <= step, f"{uid} applied a step after it was killed"
        assert f"process {uid}" in stderr
    assert stderr.count("killed by SIGKILL") >= len(victims) and "replicas verified" in stderr
    for uid in set(logs) - set(victims):
        assert int(logs[uid][-1][4]) == main["global_step"], f"{uid} did not finish"
    # one logger version, the membership in it, written by whichever process was rank 0 before and after
    (version,) = (out / "logs").iterdir()
    rows = list(csv.DictReader((version / "metrics.csv").open()))
    sizes = [row["fault_tolerance/world_size"] for row in rows if row.get("fault_tolerance/world_size")]
    assert {"3.0", "2.0"} <= set(sizes), sizes
    assert any(row.get("fault_tolerance/newcomers_healed") == "1.0" for row in rows)
    assert max(int(row["step"]) for row in rows if row["step"]) >= main["global_step"] - 1
    if hook == "powersgd":  # compressing from step 2 on; its shared state in the checkpoints
        saved = torch.load(
            next((out / "checkpoints").glob(f"*step={main['global_step']}.ckpt")), weights_only=False
        )
        entry = saved["lightning_ddpx_fault_tolerance"]
        assert entry["world_size"] == 3 and entry["hook"]["iteration"] >= 2 * STEPS_PER_EPOCH


@pytest.mark.slow
@pytest.mark.timeout(260)
@pytest.mark.parametrize(
    ("hook", "victim", "synced_at"),
    [
        ("diloco", "00000", lambda count: count % 3 == 0),  # equal after each outer step
        ("post_local_sgd", "00001", lambda count: count % 3 == 0),  # ... after each average
        ("diloco-streaming", "00002", lambda count: False),  # fragments mixed in: never all equal
    ],
    ids=["diloco-rank0", "post-local-sgd-middle", "streaming-diloco-last"],
)
@pytest.mark.processes
def test_a_trainer_with_an_averaging_hook_survives_a_lost_average_and_heals_a_copy_of_a_replica(
    tmp_path, hook, victim, synced_at
):
    """The victim dies after the third step is committed, before it is applied: the survivors' average
    after it (DiLoCo's outer step, post-local SGD's average, fragment 0's sync) fails, is put back and run
    again over the two. The replacement is admitted at the next epoch's start, where the replicas differ: it
    is healed as a copy of the lowest-ranked live replica, proved bit-identical to it."""
    out, main, logs, stderr = run_trainer_job(
        tmp_path, FAULT_JOB_KILL=f"{victim}:2:optimizer", FAULT_JOB_HOOK=hook
    )
    survivors = sorted({"00000", "00001", "00002"} - {victim})
    params: dict[int, set[str]] = defaultdict(set)
    shared: dict[int, set[str]] = defaultdict(set)
    counts: dict[int, int] = {}
    for uid, lines in logs.items():
        assert len({line[1] for line in lines}) == 1, f"{uid} was restarted"
        for _, _, _, _, step, _, _, digest, hook_column in lines:
            params[int(step)].add(digest)
            shared[int(step)].add(hook_column)
            counts[int(step)] = int(hook_column.split(":")[0])
    split = {step: found for step, found in shared.items() if len(found) > 1}
    assert not split, f"the hook's shared state differs between members at global steps {split}"
    assert all(len(params[step]) == 1 for step, count in counts.items() if synced_at(count))
    assert any(len(found) > 1 for found in params.values()), "the local steps were not local"
    assert "failed on generation 1" in stderr and "every member put its parameters back" in stderr
    assert "healed 00003" in stderr and "replicas verified" in stderr
    assert logs["00003"][0][6] == "0", f"the replacement joined mid-epoch: {logs['00003'][0]}"
    for uid in survivors:
        assert int(logs[uid][-1][4]) == expected_steps(logs), f"{uid} did not finish"
    assert main["global_step"] == expected_steps(logs)
    last = main["global_step"]
    assert main["digest"] in params[last], "fit() returned weights no training process ended with"


@pytest.mark.slow
@pytest.mark.timeout(260)
@pytest.mark.processes
def test_a_process_lost_during_validation_gives_the_survivors_one_metric_for_that_epoch(tmp_path):
    """The middle process dies in its first validation step after epoch 0. The survivors' next collective
    is the sync of a torchmetrics metric (``val_mse``, logged before the ``sync_dist`` loss): it fails, and
    every survivor regroups and syncs it again over the survivors, so their metric is one value (each
    survivor's own share's would split whatever monitors it). Training goes on, the replacement joins at a
    later epoch's start, and every later validation's metric is the same on every process too."""
    out, main, logs, stderr = run_trainer_job(tmp_path, FAULT_JOB_KILL="00001:8:validation")
    # the survivors regroup in that validation, so epoch 1 is resharded over the two: 12 steps, not 8
    assert_one_training(logs, main)
    assert main["global_step"] >= 3 * STEPS_PER_EPOCH + 12
    assert "process 00001" in stderr and "killed by SIGKILL" in stderr
    assert (
        "a collective between steps failed" in stderr
        and "every member regroups now and runs it again" in stderr
    )
    vals: dict[int, dict[str, float]] = defaultdict(dict)
    for path in out.glob("0*.val"):
        for line in path.read_text().splitlines():
            step, value = line.split()
            vals[int(step)][path.stem] = float(value)
    lost_epoch = vals.pop(STEPS_PER_EPOCH)
    assert sorted(lost_epoch) == ["00000", "00002"], lost_epoch  # the victim logged none
    assert lost_epoch["00000"] == lost_epoch["00002"], f"the survivors' metrics differ: {lost_epoch}"
    assert len(vals) == 3 and min(vals) == 20  # the ends of epochs 1 (12 steps over two), 2 and 3
    for step, by_process in vals.items():
        assert {"00000", "00002"} <= set(by_process), (step, by_process)
        assert len(set(by_process.values())) == 1, f"the metric was not synced at step {step}: {by_process}"
    assert "00003" in vals[max(vals)], "the replacement did not validate with the others"


@pytest.mark.slow
@pytest.mark.timeout(260)
@pytest.mark.processes
def test_a_trainer_accumulating_gradients_survives_a_process_killed_in_a_micro_batch(tmp_path):
    """accumulate_grad_batches=2: the middle process is SIGKILLed in the first micro-batch of global step 2,
    which accumulates locally (no gradient collective). The vote on that micro-batch finds it lost: both
    survivors regroup there and skip that micro-batch alike, the step's second micro-batch synchronises over
    the two, and a replacement is healed at a later epoch's start (an epoch that starts before it registers
    runs over the two survivors' reshard: 12 micro-batches, 6 steps)."""
    out, main, logs, stderr = run_trainer_job(
        tmp_path, FAULT_JOB_KILL="00001:2:forward", FAULT_JOB_ACCUMULATE="2", FAULT_JOB_EPOCHS="3"
    )
    total = expected_steps(logs, accumulate=2)
    assert total in (3 * STEPS_PER_EPOCH // 2, 3 * STEPS_PER_EPOCH // 2 + 2), total
    assert_one_training(logs, main, epochs=3, total_steps=total)
    assert [int(line[6]) for line in logs["00001"]] == [0, 1, 2, 3]  # died in batch 4, global step 2
    assert stderr.count("every member regroups now, each with its own answer to it") == 2
    assert "was discarded on every member" not in stderr
    assert "healed 00003" in stderr and "replicas verified" in stderr
    assert logs["00003"][0][6] == "0", f"the replacement joined mid-epoch: {logs['00003'][0]}"
    for uid in ("00000", "00002"):
        assert int(logs[uid][-1][4]) == total, f"{uid} did not finish"


@pytest.mark.timeout(260)
@pytest.mark.parametrize("accumulate", [1, 2], ids=["every-batch", "accumulating-2"])
@pytest.mark.processes
def test_a_collective_between_steps_failing_on_one_member_is_run_again_and_costs_no_batch(
    tmp_path, accumulate
):
    """After global step 4 (2 with accumulation; mid-epoch), checkpoint saving's all-reduce fails on process
    00001 alone; the others' succeeds. The vote on it tells every member: all regroup at once and run it
    again, so the decision is one on every member, every member trains the same batches, and no update is
    discarded."""
    out, main, logs, stderr = run_trainer_job(
        tmp_path,
        FAULT_JOB_KILL=f"00001:{4 // accumulate}:between",
        FAULT_JOB_REPLACEMENTS="0",
        FAULT_JOB_EPOCHS="2",
        FAULT_JOB_ACCUMULATE=str(accumulate),
    )
    assert "injected failure between steps in process 00001" in stderr
    assert stderr.count("every member regroups now and runs it again") == 3
    assert set(logs) == {"00000", "00001", "00002"}
    rows = {
        uid: [(int(line[4]), int(line[5]), int(line[6])) for line in lines] for uid, lines in logs.items()
    }
    assert rows["00000"] == rows["00001"] == rows["00002"], "the members trained different batches"
    assert "was discarded on every member" not in stderr
    assert "no peer answered" not in stderr  # nobody waited out a collective
    by_step = {int(line[4]): line[7] for line in logs["00000"]}  # after each global step's last micro-batch
    assert len(set(by_step.values())) == len(by_step), f"an update was applied nowhere: {by_step}"
    assert_one_training(logs, main, epochs=2, accumulate=accumulate)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.processes
def test_ranks_with_different_numbers_of_batches_are_refused_at_the_epochs_start_naming_each_count(tmp_path):
    """Without a DistributedSampler rank 2 gets a batch fewer: its steps and the others' would no longer
    pair up (a gradient all-reduce meeting an end-of-epoch collective). Every process refuses it at the
    epoch's start, naming each rank's count, before any step; the run ends at once (no replacement waits
    for a run whose members are all gone)."""
    out = tmp_path / "out"
    out.mkdir()
    done = run_job(
        [sys.executable, JOB, str(out)],
        timeout=150,
        env=job_env(PYTHONWARNINGS="ignore", DDPX_SHARED_MEMORY="0", FAULT_JOB_UNEVEN="1"),
    )
    assert done.returncode != 0
    assert "fault_tolerance needs every rank to get the same number of training batches" in done.stderr
    assert "gives ranks {0: 8, 1: 8, 2: 7} batches" in done.stderr
    assert not list(out.glob("0*.log")), "a step ran"
    assert "not admitted into the run within join_timeout_s" not in done.stderr


# ----------------------------------------------------------------------------- the option, no processes
def test_the_option_is_in_both_strategies_signatures_and_takes_a_bool_or_a_dict():
    import inspect

    from lightning_ddpx import DDPXStrategy
    from lightning_ddpx.fault import FaultToleranceOptions
    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as DDPXFabricStrategy

    for cls in (DDPXStrategy, DDPXFabricStrategy):
        assert inspect.signature(cls.__init__).parameters["fault_tolerance"].default is None  # off
    assert DDPXStrategy().fault_tolerance is None
    assert DDPXStrategy(fault_tolerance=False).fault_tolerance is None
    assert DDPXStrategy(fault_tolerance=True).fault_tolerance == FaultToleranceOptions()
    options = DDPXStrategy(fault_tolerance={"replacements": 2, "min_ranks": 2}).fault_tolerance
    assert (options.replacements, options.min_ranks) == (2, 2)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"comm_hook": "post_local_sgd", "post_local_sgd": {"period": 4, "subgroup": 2}}, "subgroup=2"),
        ({"overlap_optimizer": True}, "overlap_optimizer"),
        ({"uneven_inputs": "error"}, "uneven_inputs"),
        ({"fault_tolerance": {"replacement": 1}}, "replacements"),  # a typo names the valid options
        ({"fault_tolerance": {"replacements": -1}}, "replacements"),
        ({"fault_tolerance": "yes"}, "fault_tolerance"),
    ],
)
def test_what_fault_tolerance_cannot_follow_is_refused_by_name_when_the_strategy_is_built(kwargs, named):
    from lightning_ddpx import DDPXStrategy

    kwargs = {"fault_tolerance": True, **kwargs}
    with pytest.raises((ValueError, TypeError), match=named):
        DDPXStrategy(**kwargs)


def test_a_cluster_environment_of_its_own_is_refused_by_both_strategies():
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_ddpx import DDPXStrategy
    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as DDPXFabricStrategy

    for cls in (DDPXStrategy, DDPXFabricStrategy):
        with pytest.raises(ValueError, match="cluster_environment=LightningEnvironment"):
            cls(fault_tolerance=True, cluster_environment=LightningEnvironment())


def test_an_unsupported_hook_gets_one_message_from_both_strategies_and_the_bare_api():
    """The Trainer and Fabric strategies (at construction) and ``FaultTolerance.wrap`` (its check) refuse
    a hook fault tolerance cannot follow with the same words: the hook's name and the supported ones."""
    from lightning_ddpx import DDPXStrategy
    from lightning_ddpx.fault.manager import SUPPORTED_HOOKS, refuse_unsupported_hook
    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as DDPXFabricStrategy

    def my_hook(state, bucket):  # a user's hook: state the fault tolerance cannot hand on
        raise AssertionError("never called")

    messages = []
    for refuse in (
        lambda: DDPXStrategy(fault_tolerance=True, comm_hook=my_hook),
        lambda: DDPXFabricStrategy(fault_tolerance=True, comm_hook=my_hook),
        lambda: refuse_unsupported_hook(my_hook),
    ):
        with pytest.raises(ValueError) as refused:
            refuse()
        messages.append(str(refused.value))
    assert len(set(messages)) == 1, messages
    assert "comm_hook='my_hook'" in messages[0] and str(list(SUPPORTED_HOOKS)) in messages[0]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("hook", ["", "diloco", "post_local_sgd"])
@pytest.mark.processes
def test_a_fabric_loop_survives_rank_0_killed_and_heals_a_replacement(tmp_path, hook):
    out = tmp_path / "out"
    out.mkdir()
    steps = 30
    done = run_job(
        [sys.executable, "tests/jobs/fault_fabric_job.py", str(out), str(steps)],
        timeout=180,
        env=job_env(
            PYTHONWARNINGS="ignore", DDPX_SHARED_MEMORY="0", FAULT_JOB_KILL="00000:3", FAULT_JOB_HOOK=hook
        ),
    )
    assert done.returncode == 0, f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}"
    logs = {
        path.stem: [line.split() for line in path.read_text().splitlines()] for path in out.glob("0*.log")
    }
    digests: dict[int, set[str]] = defaultdict(set)
    for uid, lines in logs.items():
        assert len({line[1] for line in lines}) == 1, f"{uid} was restarted"
        for line in lines:
            digests[int(line[4])].add(line[5])
    # DiLoCo: equal after each outer step (every 5th), apart in between; post-local SGD: equal through the
    # warm-up (4 steps) and after each average (steps 5, 10, ...); else equal after every step
    synced_at = {"": lambda step: True, "diloco": lambda step: step % 5 == 0}.get(
        hook, lambda step: step <= 4 or step % 5 == 0
    )
    synced = {step: found for step, found in digests.items() if synced_at(step)}
    assert all(len(found) == 1 for found in synced.values()), synced
    assert not hook or any(len(found) > 1 for found in digests.values()), "the local steps were not local"
    # every step committed once, the discarded one retried
    assert sorted(digests) == list(range(1, steps + 1))
    assert int(logs["00000"][-1][4]) == 3  # killed during its 4th step
    assert "00003" in logs and int(logs["00003"][-1][4]) == steps, "the replacement was not healed"
    assert "healed 00003" in done.stderr
    saved = torch.load(out / "final.ckpt", weights_only=False)["lightning_ddpx_fault_tolerance"]
    assert saved["world_size"] == 3 and saved["generation"] >= 3
    if hook == "diloco":  # DiLoCo's anchors and step, saved with the model
        assert saved["hook"]["step"] == steps and len(saved["hook"]["anchors"]) == 4
    if hook == "post_local_sgd":  # its counters
        assert (saved["hook"]["iter"], saved["hook"]["averager_step"]) == (4, steps)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.processes
def test_the_same_trainer_script_runs_across_machines_under_one_launcher_per_machine(tmp_path):
    """Two launchers emulating two machines on 127.0.0.1 (node 0 hosts the store with two processes, node 1
    connects with one) run the unchanged Trainer script; node 1's process is killed mid-backward."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    launch = [sys.executable, "-m", "lightning_ddpx.fault.launch", "--world-size", "3"]
    job = ["--", JOB, str(out)]
    node0 = [*launch, "--nproc", "2", "--node-rank", "0", "--port", str(port), *job]
    node1 = [*launch, "--nproc", "1", "--node-rank", "1", "--store", f"127.0.0.1:{port}", *job]
    env = job_env(
        PYTHONWARNINGS="ignore",
        DDPX_SHARED_MEMORY="0",
        FAULT_JOB_KILL="n1-00000:2:backward",
        FAULT_JOB_EPOCHS="2",
    )
    done0, done1 = run_jobs([(node0, env), (node1, env)], timeout=200)
    assert done0.returncode == 0, done0.stderr[-4000:]
    assert done1.returncode == 1 and "killed by SIGKILL" in done1.stderr  # its only process was lost
    logs = {
        path.stem: [line.split() for line in path.read_text().splitlines()] for path in out.glob("n*.log")
    }
    digests: dict[int, set[str]] = defaultdict(set)
    for lines in logs.values():
        for line in lines:
            digests[int(line[4])].add(line[7])
    assert all(len(found) == 1 for found in digests.values()), digests
    for uid in ("n0-00000", "n0-00001"):  # epoch 1 over the two survivors' reshard: 12 steps
        assert int(logs[uid][-1][4]) == STEPS_PER_EPOCH + 12, f"{uid} did not finish"
    assert "lost n1-00000: killed by SIGKILL" in done0.stderr
    assert not (out / "main.json").exists()  # no process of the user's returns from fit: the launchers ran it


def save_on_three_and_resume_on_two(tmp_path: Path, hook: str):
    """Two epochs on three processes with ``hook`` (no replacement, no failure), then ``fit(ckpt_path=...)``
    of the checkpoint after the second epoch's last step on two processes, for three epochs: that
    checkpoint's fault-tolerance entry, the first run's ``main.json`` and logs, and the resumed run's."""
    first, first_main, first_logs, _ = run_trainer_job(
        tmp_path / "three", FAULT_JOB_HOOK=hook, FAULT_JOB_EPOCHS="2", FAULT_JOB_REPLACEMENTS="0"
    )
    checkpoint = first / "checkpoints" / "epoch=1-step=16.ckpt"
    entry = torch.load(checkpoint, weights_only=False)["lightning_ddpx_fault_tolerance"]
    _, main, logs, _ = run_trainer_job(
        tmp_path / "two",
        FAULT_JOB_HOOK=hook,
        FAULT_JOB_DEVICES="2",
        FAULT_JOB_EPOCHS="3",
        FAULT_JOB_REPLACEMENTS="0",
        FAULT_JOB_RESUME=str(checkpoint),
    )
    return entry, main, logs, first_main, first_logs


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.processes
def test_a_fault_tolerant_checkpoint_resumes_at_another_world_size_with_powersgds_shared_state(tmp_path):
    """Three processes save (rank 0 of the membership writes; the checkpoint records the world size and
    PowerSGD's shared state); two resume it with ckpt_path and continue its global step and iteration.
    The first run has no failure: three processes trained one training, and ``fit`` returned it in the
    user's process, which trained nothing."""
    entry, main, logs, first_main, first_logs = save_on_three_and_resume_on_two(tmp_path, "powersgd")
    assert sorted(first_logs) == ["00000", "00001", "00002"]
    assert_one_training(first_logs, first_main, epochs=2)
    assert first_main["status"] == "TrainerStatus.FINISHED"
    assert Path(first_main["best_model_path"]).exists()
    assert first_main["pid"] not in {int(lines[0][1]) for lines in first_logs.values()}
    assert (entry["world_size"], entry["hook"]["iteration"]) == (3, 16)
    assert sorted(logs) == ["00000", "00001"]
    first_rows = [lines[0] for lines in logs.values()]
    # world size 2, the global step and PowerSGD's iteration going on from the checkpoint's 16
    assert {(row[3], row[4], row[5], row[8].split(":")[0]) for row in first_rows} == {("2", "17", "2", "17")}
    # trained to the end (how many batches the resumed epoch takes is Lightning's mid-epoch resume: the
    # checkpoint was written after the epoch's last batch, before the epoch ended)
    assert main["epoch"] == 3 and main["global_step"] > 16
    steps = defaultdict(set)
    for lines in logs.values():
        for line in lines:
            steps[int(line[4])].add((line[7], line[8]))
    assert all(len(found) == 1 for found in steps.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.processes
def test_a_fault_tolerant_diloco_checkpoint_resumes_at_another_world_size_with_its_anchors(tmp_path):
    """DiLoCo (an outer step every 3 inner steps) under fault tolerance: three processes save, the checkpoint
    holds DiLoCo's whole shared state (inner steps, anchors, outer momentum); two resume it and go on from
    its inner step, with the anchors equal on both at every step."""
    entry, main, logs, _, _ = save_on_three_and_resume_on_two(tmp_path, "diloco")
    assert entry["world_size"] == 3 and entry["hook"]["step"] == 16 and entry["hook"]["syncs"] == 5
    assert sorted(logs) == ["00000", "00001"]
    first_rows = [lines[0] for lines in logs.values()]
    assert {(row[3], row[4], row[8].split(":")[0]) for row in first_rows} == {("2", "17", "17")}
    anchors = defaultdict(set)
    for lines in logs.values():
        for line in lines:
            anchors[int(line[4])].add(line[8])
    assert all(len(found) == 1 for found in anchors.values()), anchors
    assert main["global_step"] > 16


def test_the_metric_sync_guard_routes_each_metrics_sync_between_steps_and_gives_it_back():
    """Each torchmetrics metric of the module (nested ones too) syncs through the fault tolerance's
    between-steps rule; its fallback leaves the metric unsynced (its own value); released, the metric has its
    own ``sync`` again and pickles."""
    import pickle

    import torchmetrics
    from torch import nn

    from lightning_ddpx.lightning.fault_tolerance.metrics import MetricSyncGuard

    routed = []

    def between_steps(run, fallback):  # as in a newcomer before its heal: the fallback answers
        routed.append(run)
        return fallback()

    module = nn.Module()
    module.mse = torchmetrics.MeanSquaredError()
    module.head = nn.Sequential(nn.Linear(2, 2), torchmetrics.SumMetric())
    guard = MetricSyncGuard(between_steps)
    assert guard.guard(module) == 2 and guard.guard(module) == 0  # once each
    module.mse.update(torch.ones(3), torch.zeros(3))
    assert float(module.mse.compute()) == 1.0 and len(routed) == 1
    assert not module.mse._is_synced  # left unsynced: this process's own value
    guard.release()
    assert "sync" not in module.mse.__dict__ and "sync" not in module.head[1].__dict__
    module.mse.reset()
    module.mse.update(torch.ones(2), torch.zeros(2))
    assert float(module.mse.compute()) == 1.0 and len(routed) == 1  # its own sync again
    pickle.dumps(module)
