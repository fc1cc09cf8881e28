"""Checkpoints that survive a killed writer and load with ``torch.load(weights_only=True)``.

1. ``AtomicCheckpointIO``: a process SIGKILLed while writing (half the bytes written; everything written
   but not yet renamed; killed from outside at whatever point it reached) leaves the previous checkpoint
   readable, and its temporary file matches none of the names Lightning takes for checkpoints. Lightning's
   own ``TorchCheckpointIO`` tears the target in the same situation when ``$TMPDIR`` is on another
   filesystem (the reason this plugin exists).
2. Every checkpoint ``DDPXStrategy`` writes -- no hook, named hooks, a wrapper, a user's stateful callable
   given as a function or as its import path -- loads with ``weights_only=True`` and records the hook by
   name; a hook state holding something that is not a tensor or plain value is refused when saving, on
   every rank, instead of being pickled.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ddpx import collectives_issued_on_call
from lightning_ddpx.lightning.checkpoints.checkpoint_io import (
    TEMP_PREFIX,
    TEMP_SUFFIX,
    AtomicCheckpointIO,
    atomic_torch_save,
)
from tests.dist_utils import REPO_ROOT, job_env, run_distributed, run_job
from tests.jobs.kill_during_save import NUMEL
from tests.strategy_helpers import fit, quiet

HOOK_PATH = f"{__name__}.stateful_mean_hook"  # tests.lightning.test_checkpoint_safety.stateful_mean_hook


# ------------------------------------------------------------------------------- atomic writes
def write_old(path: str) -> None:
    torch.save({"version": 0, "weights": torch.zeros(8)}, path)


def assert_old(path: str) -> None:
    loaded = torch.load(path, weights_only=True)
    assert loaded["version"] == 0 and torch.equal(loaded["weights"], torch.zeros(8))


def kill_during_save(mode: str, target: str, env: dict[str, str] | None = None) -> None:
    """Run tests/jobs/kill_during_save.py; it must die of SIGKILL (not finish, not fail otherwise)."""
    result = run_job(
        [sys.executable, "-m", "tests.jobs.kill_during_save", mode, target], 120, job_env(**(env or {}))
    )
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stdout, result.stderr[-3000:])


def temporary_files(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith(TEMP_PREFIX))


def assert_not_taken_for_a_checkpoint(name: str) -> None:
    """The names Lightning looks for: ModelCheckpoint's ``*.ckpt`` and ``last*.ckpt``, SLURM's ``hpc_ckpt_``."""
    assert name.startswith(".") and name.endswith(TEMP_SUFFIX), name
    assert not name.endswith(ModelCheckpoint.FILE_EXTENSION) and "hpc_ckpt_" not in name, name
    assert not re.match(rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}", name), name


def test_write_round_trips_and_leaves_only_the_target(tmp_path):
    target = tmp_path / "sub" / "epoch=0.ckpt"  # the directory is created, as Lightning's IO does
    AtomicCheckpointIO().save_checkpoint({"version": 3, "weights": torch.arange(5.0)}, str(target))
    loaded = torch.load(target, weights_only=True)
    assert loaded["version"] == 3 and torch.equal(loaded["weights"], torch.arange(5.0))
    assert os.listdir(target.parent) == ["epoch=0.ckpt"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask, "permissions as a plain open would give"


def test_overwrite_replaces_the_file_and_follows_a_link_name(tmp_path):
    target = str(tmp_path / "last.ckpt")
    write_old(target)
    atomic_torch_save({"version": 1}, target)
    assert torch.load(target, weights_only=True) == {"version": 1}
    assert temporary_files(str(tmp_path)) == []


def test_exception_while_writing_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    from lightning_ddpx.engine import atomic_file

    target = str(tmp_path / "last.ckpt")
    write_old(target)

    def failing_write(obj: Any, file: Any) -> None:
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(atomic_file, "_write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        AtomicCheckpointIO().save_checkpoint({"version": 1}, target)
    assert_old(target)
    assert os.listdir(tmp_path) == ["last.ckpt"]


@pytest.mark.parametrize("mode", ["mid-write", "before-replace"])
@pytest.mark.processes
def test_sigkill_while_writing_leaves_the_previous_checkpoint_readable(tmp_path, mode):
    target = str(tmp_path / "last.ckpt")
    write_old(target)
    kill_during_save(mode, target)
    assert_old(target)
    (leftover,) = temporary_files(str(tmp_path))  # the kill really happened with a write in progress
    assert_not_taken_for_a_checkpoint(leftover)
    written = os.path.getsize(tmp_path / leftover)
    assert (written < NUMEL * 4 // 2 + 4096) if mode == "mid-write" else (written > NUMEL * 4)
    assert sorted(os.listdir(tmp_path)) == sorted([leftover, "last.ckpt"])


@pytest.mark.processes
def test_sigkill_from_outside_at_any_point_leaves_a_whole_checkpoint(tmp_path):
    """A real external SIGKILL of a process saving in a loop, sent while a temporary file exists: whatever
    step it interrupts, the target holds one complete version."""
    target = str(tmp_path / "last.ckpt")
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.jobs.kill_during_save", "loop", target],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "1", "the first save completed"
        deadline = time.monotonic() + 60
        while not temporary_files(str(tmp_path)):  # the next save has opened its temporary file
            assert time.monotonic() < deadline and child.poll() is None, "the child stopped saving"
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        saved = [int(line) for line in child.stdout.read().split()]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    last_done = saved[-1] if saved else 1
    loaded = torch.load(target, weights_only=True)
    assert loaded["version"] in (last_done, last_done + 1)  # before or after the interrupted save's rename
    assert torch.equal(loaded["weights"], torch.full((NUMEL,), float(loaded["version"])))
    for name in temporary_files(str(tmp_path)):
        assert_not_taken_for_a_checkpoint(name)


def _other_filesystem_than_tmp() -> str | None:
    tmp = tempfile.gettempdir()
    for candidate in ("/dev/shm", "/run/shm"):
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            if os.stat(candidate).st_dev != os.stat(tmp).st_dev:
                return candidate
    return None


@pytest.mark.processes
def test_lightning_default_write_tears_the_target_across_filesystems():
    """Why AtomicCheckpointIO exists. TorchCheckpointIO writes its temporary file in $TMPDIR; when the
    checkpoint directory is on another filesystem, shutil.move copies into the target, and a kill during the
    copy leaves a checkpoint that no longer loads. (If this starts failing, Lightning's write became atomic.)"""
    other = _other_filesystem_than_tmp()
    if other is None:
        pytest.skip("needs a writable directory on another filesystem than $TMPDIR (e.g. /dev/shm)")
    directory = tempfile.mkdtemp(dir=other)
    try:
        target = os.path.join(directory, "last.ckpt")
        write_old(target)
        kill_during_save("lightning-copy", target)
        with pytest.raises(RuntimeError, match="central directory|zip archive"):
            torch.load(target, weights_only=True)
        assert os.path.getsize(target) == 1 << 20, "the first MiB of the new file replaced the old one"
    finally:
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        os.rmdir(directory)
        _remove_orphans_of_lightning()


def _remove_orphans_of_lightning() -> None:
    """TorchCheckpointIO's killed write leaves a 16 MiB ``tmp*`` file in $TMPDIR; remove ours (16 MiB + header)."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        if re.fullmatch(r"tmp[a-z0-9_]{8}", name) and os.path.isfile(path):
            if (
                NUMEL * 4 < os.path.getsize(path) < NUMEL * 4 + 4096
                and time.time() - os.path.getmtime(path) < 120
            ):
                os.remove(path)


def test_remote_urls_keep_lightnings_write(tmp_path):
    import fsspec

    AtomicCheckpointIO().save_checkpoint({"version": 2}, "memory://ddpx/last.ckpt")
    with fsspec.open("memory://ddpx/last.ckpt", "rb") as file:
        assert torch.load(file, weights_only=True) == {"version": 2}
    local_url = f"file://{tmp_path}/last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"version": 3}, local_url)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True) == {"version": 3}
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint({"version": 4}, str(tmp_path / "x.ckpt"), storage_options={})


def test_is_lightnings_checkpoint_io():
    assert isinstance(AtomicCheckpointIO(), TorchCheckpointIO)


# ------------------------------------------------------------------- what the strategy writes
class CountingState:
    """A user's hook state with ``state_dict``: a shared call count and a per-rank gradient sum."""

    def __init__(self, extra_shared: dict | None = None, extra_per_rank_on: tuple[int, Any] | None = None):
        self.calls = 0
        self.local_sum = torch.zeros(())
        self.extra_shared = extra_shared or {}
        self.extra_per_rank_on = extra_per_rank_on  # (rank, value): an extra per-rank value on that rank only

    def state_dict(self) -> dict:
        per_rank: dict[str, Any] = {"local_sum": self.local_sum.clone()}
        if self.extra_per_rank_on is not None and dist.get_rank() == self.extra_per_rank_on[0]:
            per_rank["extra"] = self.extra_per_rank_on[1]
        return {"shared": {"calls": self.calls, **self.extra_shared}, "per_rank": per_rank}

    def load_state_dict(self, state_dict: dict) -> None:
        self.calls = state_dict["shared"]["calls"]
        self.local_sum = state_dict["per_rank"].get("local_sum", torch.zeros(()))


@collectives_issued_on_call
def stateful_mean_hook(state: CountingState, bucket: Any) -> torch.futures.Future:
    """Mean allreduce that remembers how often it ran and this rank's unreduced gradient sum."""
    buffer = bucket.buffer()
    state.calls += 1
    state.local_sum += buffer.sum()
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future()


SAVED_CASES: dict[str, dict[str, Any]] = {
    "no_hook": {},
    "allreduce": {"comm_hook": "allreduce"},
    "fp16": {"comm_hook": "fp16"},
    "powersgd": {"comm_hook": "powersgd", "powersgd": {"start_powerSGD_iter": 2}},
    "batched_powersgd": {"comm_hook": "batched_powersgd", "powersgd": {"start_powerSGD_iter": 2}},
    "fp16_wrapped_powersgd": {
        "comm_hook": "powersgd",
        "comm_wrapper": "fp16",
        "powersgd": {"start_powerSGD_iter": 2},
    },
    "callable": {"comm_hook": stateful_mean_hook, "comm_state": CountingState},
    "import_path": {"comm_hook": HOOK_PATH, "comm_state": CountingState},
}


def _strategy(options: dict[str, Any]) -> Any:
    from lightning_ddpx import DDPXStrategy

    options = dict(options)
    if isinstance(options.get("comm_state"), type):  # a fresh state for every fit
        options["comm_state"] = options["comm_state"]()
    return DDPXStrategy(checkpoint_io=AtomicCheckpointIO(), **options)


def save_everything_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    out: dict[str, Any] = {}
    for name, options in SAVED_CASES.items():
        callback = ModelCheckpoint(
            dirpath=os.path.join(directory, name),
            filename="{step}",
            every_n_train_steps=2,
            save_top_k=-1,
            save_last=True,
        )
        trainer, _ = fit(_strategy(options), max_steps=4, enable_checkpointing=True, callbacks=[callback])
        trainer.save_checkpoint(os.path.join(directory, name, "after-fit.ckpt"))
        state = trainer.strategy.comm_hook_state
        out[name] = {"calls": getattr(state, "calls", None), "local_sum": getattr(state, "local_sum", None)}

    # A state whose state_dict holds something weights_only cannot read: refused when saving, nothing written.
    refused = {
        "object_in_shared": CountingState(extra_shared={"sampler": object()}),
        "lambda_on_rank_1_only": CountingState(extra_per_rank_on=(1, lambda step: step)),
    }
    for name, state in refused.items():
        trainer, _ = fit(_strategy({"comm_hook": stateful_mean_hook, "comm_state": state}), max_steps=2)
        path = os.path.join(directory, f"{name}.ckpt")
        try:
            trainer.save_checkpoint(path)
            out[name] = None
        except TypeError as error:
            out[name] = str(error)
        out[f"{name}/written"] = os.path.exists(path)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict]]:
    directory = str(tmp_path_factory.mktemp("safe"))
    results = run_distributed(
        save_everything_job, 2, directory, init_process_group=False, timeout=300, pg_timeout=120
    )
    return directory, results


EXPECTED_HOOK_NAMES = {
    "no_hook": "allreduce",
    "allreduce": "allreduce",
    "fp16": "fp16",
    "powersgd": "powersgd",
    "batched_powersgd": "batched_powersgd",
    "fp16_wrapped_powersgd": "fp16(powersgd)",
    "callable": HOOK_PATH,
    "import_path": HOOK_PATH,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SAVED_CASES))
@pytest.mark.processes
def test_every_checkpoint_loads_with_weights_only(saved, case):
    directory, results = saved
    files = sorted(os.listdir(os.path.join(directory, case)))
    assert files == ["after-fit.ckpt", "last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    for name in files:
        checkpoint = torch.load(os.path.join(directory, case, name), weights_only=True)
        entry = checkpoint["lightning_ddpx"]
        assert entry["hook"] == EXPECTED_HOOK_NAMES[case] and entry["world_size"] == 2, (name, entry["hook"])
        assert checkpoint["global_step"] == (2 if name == "step=2.ckpt" else 4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["callable", "import_path"])
@pytest.mark.processes
def test_callable_hook_is_recorded_by_import_path_with_every_ranks_state(saved, case):
    directory, results = saved
    entry = torch.load(os.path.join(directory, case, "after-fit.ckpt"), weights_only=True)["lightning_ddpx"]
    assert entry["hook"] == HOOK_PATH
    assert entry["shared"] == {"calls": results[0][case]["calls"]} and entry["shared"]["calls"] > 0
    sums = [part["local_sum"] for part in entry["per_rank"]]
    for rank, rank_result in enumerate(results):
        assert torch.equal(sums[rank], rank_result[case]["local_sum"])
    assert not torch.equal(sums[0], sums[1]), "each rank's own part is kept"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("object_in_shared", ["rank 0", "'shared']['sampler']", "builtins.object"]),
        ("lambda_on_rank_1_only", ["rank 1", "'per_rank']['extra']", "function"]),
    ],
)
@pytest.mark.processes
def test_hook_state_that_is_not_plain_is_refused_on_every_rank(saved, case, names):
    directory, results = saved
    for rank_result in results:
        message = rank_result[case]
        assert message is not None, "saving must fail instead of pickling the value"
        for part in [HOOK_PATH, "CountingState.state_dict()", "weights_only=True", "Convert it", *names]:
            assert part in message, (part, message)
        assert rank_result[f"{case}/written"] is False


@pytest.mark.slow
@pytest.mark.processes
def test_no_temporary_files_are_left_by_the_strategy(saved):
    directory, _ = saved
    for root, _, names in os.walk(directory):
        assert not [name for name in names if name.startswith(TEMP_PREFIX)], root
