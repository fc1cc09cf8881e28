"""Fault tolerance in a real project's shape: what users combine (tests/jobs/fault_project_job.py), killed where it hurts.

Each run is ``python tests/jobs/fault_project_job.py`` as a user starts it: validation with torchmetrics and
``sync_dist``, ``ReduceLROnPlateau`` on ``val_loss`` and a step scheduler, ``ModelCheckpoint`` top-k and last,
``EarlyStopping``, ``LearningRateMonitor``, CSV and TensorBoard loggers, gradient clipping, BatchNorm;
one run may kill several processes at several stages (shared processes keep CI's time down). The oracles:

- every member's whole checkpoint state (weights, optimizer, schedulers, loops, each callback) identical
  after every step, naming the piece and the step that differ;
- each epoch's training and validation samples covered exactly once by the members present, in every epoch
  whose membership did not change while it ran;
- what ModelCheckpoint reports the same on every member and true of the files on disk, and the
  ``best_model_path`` the user's process gets a file that loads;
- one CSV log, whole: a ``val_loss`` for every epoch, the columns of every metric logged;
- ``fit`` returning in the user's process, and no wait on a timeout while every process was alive.
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.dist_utils import job_env, run_job

JOB = "tests/jobs/fault_project_job.py"
TRAIN_SAMPLES, VAL_SAMPLES = 384, 192

pytestmark = [pytest.mark.slow, pytest.mark.processes]


def run_project(tmp_path: Path, **env: str) -> tuple[Path, dict, str]:
    out = tmp_path / "out"
    out.mkdir(parents=True)
    done = run_job(
        [sys.executable, JOB, str(out)],
        timeout=240,
        env=job_env(**{"PYTHONWARNINGS": "ignore", "DDPX_SHARED_MEMORY": "0", **env}),
    )
    assert done.returncode == 0, f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-8000:]}"
    return out, json.loads((out / "main.json").read_text()), done.stderr


def assert_one_state(out: Path, main: dict) -> None:
    """Every member's whole state equal after every step, and the run ending where fit says it did."""
    by_step: dict[tuple[int, int], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in out.glob("*.state"):
        for line in path.read_text().splitlines():
            step_and_batch, _, _, *pieces = line.split()
            step, batch = (int(n) for n in step_and_batch.split(":"))
            for piece in pieces:
                name, digest = piece.split("=", 1)
                by_step[(step, batch)][name].add(digest)
    apart = {
        step: sorted(name for name, digests in pieces.items() if len(digests) > 1)
        for step, pieces in sorted(by_step.items())
    }
    apart = {step: names for step, names in apart.items() if names}
    assert not apart, f"the members' states differ ((global step, batch): pieces): {apart}"
    assert main["global_step"] == max(by_step)[0], (main["global_step"], max(by_step))


def assert_each_epoch_covered_once(out: Path, changed_epochs: set[int]) -> None:
    """Training and validation: every sample once per epoch over the members present, for every epoch
    whose membership did not change while it ran (``changed_epochs``: where a member was lost or joined)."""
    seen: dict[tuple[str, int], list[int]] = defaultdict(list)
    sizes: dict[tuple[str, int], set[int]] = defaultdict(set)
    for path in out.glob("*.seen"):
        for line in path.read_text().splitlines():
            kind, epoch, world_size, *indices = line.split()
            seen[(kind, int(epoch))] += [int(i) for i in indices]
            sizes[(kind, int(epoch))].add(int(world_size))
    epochs = {epoch for _, epoch in seen}
    for epoch in sorted(epochs - changed_epochs):
        for kind, total in (("train", TRAIN_SAMPLES), ("val", VAL_SAMPLES)):
            indices = seen[(kind, epoch)]
            assert len(sizes[(kind, epoch)]) == 1, (
                f"{kind} epoch {epoch} ran at world sizes {sizes[(kind, epoch)]}"
            )
            assert sorted(indices) == list(range(total)), (
                f"{kind} epoch {epoch} (world size {sizes[(kind, epoch)]}): {len(indices)} samples seen, "
                f"{len(set(indices))} distinct, of {total}"
            )


def assert_checkpoints_true(out: Path, main: dict) -> None:
    reports = {path.stem: json.loads(path.read_text()) for path in out.glob("*.checkpoints")}
    assert reports, "no training process reported its ModelCheckpoint"
    first = next(iter(reports.values()))
    assert all(report == first for report in reports.values()), f"members' ModelCheckpoint differ: {reports}"
    on_disk = sorted(str(p) for p in (out / "checkpoints").iterdir())
    assert on_disk == sorted({*first["best_k_models"], first["last_model_path"]}), (on_disk, first)
    assert main["best_model_path"] == first["best_model_path"] and main["best_loads"], main


def assert_whole_csv_log(out: Path, epochs: int) -> None:
    (version,) = (out / "csv").iterdir()
    rows = list(csv.DictReader((version / "metrics.csv").open()))
    validated = sorted(int(row["epoch"]) for row in rows if row.get("val_loss"))
    assert validated == list(range(epochs)), f"epochs with a val_loss in metrics.csv: {validated}"
    assert any(row.get("lr-Adam") for row in rows), "LearningRateMonitor's column is missing"
    (tensorboard,) = (out / "tb").iterdir()
    assert list(tensorboard.glob("events.out.tfevents.*")), "TensorBoard wrote nothing"


def changed_epochs(out: Path) -> set[int]:
    """The epochs during which the membership changed: a training line's world size differs within it."""
    sizes: dict[int, set[int]] = defaultdict(set)
    for path in out.glob("*.seen"):
        for line in path.read_text().splitlines():
            _, epoch, world_size, *_ = line.split()
            sizes[int(epoch)].add(int(world_size))
    return {epoch for epoch, found in sizes.items() if len(found) > 1}


def assert_project_run(out: Path, main: dict, stderr: str, epochs: int, expect_changed: set[int]) -> None:
    assert_one_state(out, main)
    changed = changed_epochs(out)
    assert changed <= expect_changed, f"the membership changed in epochs {changed}, expected {expect_changed}"
    assert_each_epoch_covered_once(out, expect_changed)
    assert_checkpoints_true(out, main)
    assert_whole_csv_log(out, epochs)
    assert "Timed out" not in stderr and "no peer answered" not in stderr, stderr[-4000:]
    assert main["epoch"] == epochs


@pytest.mark.timeout(300)
def test_rank0_killed_in_validation_leaves_no_divergence(tmp_path):
    """The set-up users reported: rank 0 SIGKILLed in its second validation batch. The survivors' val_loss
    is one value (the reduction rerun over them), so their schedulers, checkpoints and early stopping
    decide alike; the replacement heals at the next epoch with every callback's state."""
    out, main, stderr = run_project(tmp_path, PROJECT_KILLS="rank0:validation:1", PROJECT_EPOCHS="4")
    assert "killed by SIGKILL" in stderr and "healed 00003" in stderr
    assert_project_run(out, main, stderr, epochs=4, expect_changed={1})
    values = defaultdict(set)
    for path in out.glob("*.val"):
        for line in path.read_text().splitlines():
            epoch, loss, lr = line.split()
            values[int(epoch)].add((loss, lr))
    assert all(len(found) == 1 for found in values.values()), f"val_loss or lr differ: {dict(values)}"


@pytest.mark.timeout(300)
def test_two_losses_in_training_and_in_a_save_with_two_replacements(tmp_path):
    """A member lost in a training step, healed; then rank 0 lost inside the epoch's top-k save, after the
    heal: the files on disk stay what every member's ModelCheckpoint says."""
    out, main, stderr = run_project(
        tmp_path,
        PROJECT_KILLS="rank1:train:0,rank0:save:2",
        PROJECT_REPLACEMENTS="2",
        PROJECT_EPOCHS="4",
    )
    assert len(list(out.glob("kill-*.done"))) == 2 and "healed 00004" in stderr
    assert_project_run(out, main, stderr, epochs=4, expect_changed={0, 2})


@pytest.mark.timeout(300)
def test_a_smaller_world_covers_each_epoch_with_accumulation(tmp_path):
    """Four processes, one lost in epoch 0's training and rank 0 at epoch 1's very end, no replacement: epoch 1
    (three processes) and epoch 2 (two) each cover every sample once (the samplers and the loop's batch
    count follow the membership), with gradient accumulation."""
    out, main, stderr = run_project(
        tmp_path,
        PROJECT_KILLS="rank2:train:0,rank0:epoch_end:1",
        PROJECT_DEVICES="4",
        PROJECT_REPLACEMENTS="0",
        PROJECT_ACCUMULATE="2",
        PROJECT_EPOCHS="3",
    )
    assert_project_run(out, main, stderr, epochs=3, expect_changed={0})
    assert len(list(out.glob("kill-*.done"))) == 2
    sizes = {
        line.split()[1]: line.split()[2]
        for path in out.glob("*.seen")
        for line in path.read_text().splitlines()
    }
    assert sizes["1"] == "3" and sizes["2"] == "2", sizes


def run_failing_project(tmp_path: Path, **env: str):
    out = tmp_path / "out"
    out.mkdir(parents=True)
    return out, run_job(
        [sys.executable, JOB, str(out)],
        timeout=120,
        env=job_env(**{"PYTHONWARNINGS": "ignore", "DDPX_SHARED_MEMORY": "0", **env}),
    )


@pytest.mark.timeout(150)
def test_what_the_users_process_can_check_is_refused_there_before_any_training_process_starts(tmp_path):
    out, done = run_failing_project(tmp_path, PROJECT_FAIL="manual")
    assert done.returncode != 0
    assert "ValueError: DDPXStrategy: fault_tolerance supports automatic optimisation only" in done.stderr
    assert "starting 3 process(es)" not in done.stderr, "training processes were started"
    assert not list(out.glob("*.seen"))


@pytest.mark.timeout(150)
def test_an_error_every_training_process_raises_is_raised_by_fit_and_not_retried(tmp_path):
    out, done = run_failing_project(tmp_path, PROJECT_FAIL="raise", PROJECT_EPOCHS="3")
    assert done.returncode != 0
    tail = done.stderr.strip().splitlines()[-12:]
    assert any("ValueError: the training code's own error, in every process" in line for line in tail), tail
    assert "raised in training process" in done.stderr
    assert "not replaced (a replacement would raise it again)" in done.stderr
    assert "started process 00003" not in done.stderr, "a replacement was started to raise it again"
    assert "none returned the trained model" not in done.stderr


@pytest.mark.timeout(150)
def test_ctrl_c_on_the_users_process_says_it_was_interrupted_and_leaves_nothing(tmp_path):
    import os
    import signal
    import subprocess
    import time

    out = tmp_path / "out"
    out.mkdir(parents=True)
    env = job_env(PYTHONWARNINGS="ignore", DDPX_SHARED_MEMORY="0", PROJECT_EPOCHS="50")
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, JOB, str(out)],
            env=env,
            stderr=stderr,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 90
            while not list(out.glob("*.state")) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert list(out.glob("*.state")), "training did not start"
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    text = (tmp_path / "stderr").read_text()
    assert process.returncode != 0
    assert "interrupted (Ctrl-C)" in text, text[-3000:]
    assert "every process was lost" not in text
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the run left behind: {left}"
