"""LightningCLI: the example script trains on 2 processes from a YAML file and from command-line flags, and
every shipped config parses into the strategy it describes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import REPO_ROOT, job_env, run_job

SCRIPT = REPO_ROOT / "examples" / "cli_train.py"
CONFIGS = sorted((REPO_ROOT / "examples" / "configs").glob("*.yaml"))
SHORT = ["--trainer.max_steps=6", "--trainer.limit_val_batches=1", "--trainer.enable_model_summary=false"]


def run_cli(arguments: list[str], root: Path) -> Path:
    """Run ``cli_train.py fit`` (Lightning starts the second process) and return its checkpoint."""
    command = [sys.executable, str(SCRIPT), "fit", *arguments, *SHORT, f"--trainer.default_root_dir={root}"]
    done = run_job(command, timeout=240, env=job_env(PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, f"{' '.join(command)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    (checkpoint,) = root.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    return checkpoint


def hook_entry(checkpoint: Path) -> dict:
    return torch.load(checkpoint, weights_only=True)["lightning_ddpx"]


@pytest.mark.slow
@pytest.mark.processes
def test_yaml_config_trains_on_two_processes(tmp_path):
    config = REPO_ROOT / "examples" / "configs" / "powersgd.yaml"
    checkpoint = run_cli(
        ["--config", str(config), "--trainer.strategy.powersgd.start_powerSGD_iter=2"], tmp_path
    )
    entry = hook_entry(checkpoint)
    assert entry["hook"] == "powersgd" and entry["world_size"] == 2 and len(entry["per_rank"]) == 2
    assert entry["shared"]["options"]["matrix_approximation_rank"] == 4  # from the YAML file
    assert entry["shared"]["iteration"] == 6
    saved = (tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "class_path: lightning_ddpx.DDPXStrategy" in saved and "comm_hook: powersgd" in saved


@pytest.mark.slow
@pytest.mark.processes
def test_post_local_sgd_yaml_trains_and_checkpoints_its_counters(tmp_path):
    config = REPO_ROOT / "examples" / "configs" / "post_local_sgd.yaml"
    checkpoint = run_cli(
        ["--config", str(config), "--trainer.strategy.post_local_sgd.start_localSGD_iter=2"], tmp_path
    )
    saved = torch.load(checkpoint, weights_only=True)
    entry = saved["lightning_ddpx"]
    assert entry["hook"] == "post_local_sgd" and entry["world_size"] == 2
    assert (entry["shared"]["iter"], entry["shared"]["averager_step"]) == (2, 6)
    assert saved["lightning_ddpx_replicas"][0] is None and saved["lightning_ddpx_replicas"][1] is not None
    config_saved = (tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "comm_hook: post_local_sgd" in config_saved and "model_averaging_period: 4" in config_saved


@pytest.mark.slow
@pytest.mark.processes
def test_command_line_flags_train_on_two_processes(tmp_path):
    flags = [
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=lightning_ddpx.DDPXStrategy",
        "--trainer.strategy.comm_hook=powersgd",
        "--trainer.strategy.powersgd.matrix_approximation_rank=4",
        "--trainer.strategy.powersgd.start_powerSGD_iter=2",
    ]
    entry = hook_entry(run_cli(flags, tmp_path))
    assert entry["hook"] == "powersgd" and len(entry["per_rank"]) == 2
    assert entry["shared"]["options"]["matrix_approximation_rank"] == 4


@pytest.fixture(scope="module")
def cli_train():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import cli_train
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return cli_train


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_builds_its_strategy(config, cli_train, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    from lightning_ddpx import DDPXStrategy

    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])  # pytest's own arguments are not the CLI's
    cli = LightningCLI(
        cli_train.DigitsClassifier,
        cli_train.DigitsDataModule,
        run=False,
        args=["--config", str(config)],
        save_config_callback=None,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DDPXStrategy)
    expected = {"fp16_powersgd": "fp16(powersgd)", "fault_tolerance": "allreduce", "sparseloco": "diloco"}
    assert strategy.hook_name == expected.get(config.stem, config.stem)
    if config.stem == "fault_tolerance":
        assert strategy.fault_tolerance.replacements == 1
        assert strategy.fault_tolerance.heartbeat_timeout_s == 10.0
    if "powersgd" in config.stem:
        assert strategy.powersgd.matrix_approximation_rank == 4
    if config.stem == "post_local_sgd":
        assert strategy.model_averaging_period == 4
        assert (strategy.post_local_sgd.start_localSGD_iter, strategy.post_local_sgd.subgroup) == (20, 1)
        assert strategy.post_local_sgd.period == 4  # model_averaging_period, filled in
    if config.stem == "diloco":
        o = strategy.diloco
        assert (o.period, o.fragments, o.overlap_steps, o.precision, o.nesterov) == (20, 2, 1, "int4", True)
    if config.stem == "sparseloco":
        sparse = strategy.diloco.sparse
        assert (sparse.density, sparse.bits, sparse.chunk, sparse.error_decay) == (0.04, 2, 4096, 0.999)


@pytest.mark.slow
@pytest.mark.processes
def test_lightning_demo_trains_checkpoints_and_resumes(tmp_path):
    command = [
        sys.executable,
        str(REPO_ROOT / "examples" / "lightning_demo.py"),
        "--epochs=1",
        "--resume-epochs=1",
    ]
    done = run_job([*command, f"--workdir={tmp_path}"], timeout=240, cwd=tmp_path)
    assert done.returncode == 0, f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert "per rank 1: error feedback of" in done.stdout
    assert "hook state restored at PowerSGD step 22" in done.stdout
    assert "parameters identical on both processes: yes" in done.stdout
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["phase1.ckpt", "phase2.ckpt"]
