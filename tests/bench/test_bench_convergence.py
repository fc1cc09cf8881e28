"""Time to accuracy (``--convergence``, benchmarks/bench_convergence.py): the summary and recommendation
logic on hand-made curves, the two built-in tasks' data, and two short end-to-end smoke runs (loopback, one contender each: a contender is a Trainer.fit in 2 fresh
processes, about 25 s on 2 quiet cores)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpx.bench.contenders import CONTENDERS
from lightning_ddpx.bench.convergence import (
    accuracy_verdicts,
    convergence_contenders_named,
    default_target,
    recommend_from_convergence,
    summarize_runs,
)
from lightning_ddpx.bench.convergence_cli import DEFAULT_CONTENDERS, load_accuracy_verdicts
from lightning_ddpx.bench.report import recommend
from lightning_ddpx.bench.tasks import DigitsCNN, DigitsUpscaled, PydocText, pydoc_tokens
from tests.bench.test_bench_cli import _row
from tests.dist_utils import run_job


def curve(step_s: float, metrics: list[float], every: int = 10, sent: float = 100.0) -> dict[str, Any]:
    """A rank-0 record: ``len(metrics) * every`` steps of ``step_s`` each, a validation every ``every``."""
    steps = len(metrics) * every
    return {
        "time_s": [step_s * (i + 1) for i in range(steps)],
        "bytes_sent": [sent] * steps,
        "train_loss": [1.0] * steps,
        "val": [
            {"step": every * (i + 1), "time_s": step_s * every * (i + 1), "metric": m}
            for i, m in enumerate(metrics)
        ],
    }


RUNS = {
    "torch-ddp": curve(0.3, [0.5, 0.8, 0.90, 0.94, 0.96], sent=1000.0),
    "allreduce": curve(0.3, [0.5, 0.8, 0.90, 0.94, 0.96], sent=1000.0),
    "powersgd-r2": curve(0.1, [0.4, 0.7, 0.88, 0.95, 0.945], sent=10.0),  # 3x faster steps, ends 0.0025 lower
    "powersgd-r1-noef": curve(0.08, [0.3, 0.5, 0.7, 0.8, 0.85], sent=5.0),  # fastest, 11 points short
}


def test_summary_times_the_target_and_checks_accuracy_at_equal_steps() -> None:
    contenders = convergence_contenders_named(list(RUNS))
    target = default_target(RUNS, "max", 0.01)
    assert target == pytest.approx((0.94 + 0.96) / 2 - 0.01)  # torch's last two validations, less tolerance
    rows = {r.name: r for r in summarize_runs(contenders, RUNS, target, "max", 0.01)}
    # torch reaches 0.94 at its 4th validation (step 40: 12 s); powersgd-r2 reaches 0.95 at step 40 (4 s)
    assert rows["torch-ddp"].time_to_target_s == pytest.approx(12.0)
    assert rows["powersgd-r2"].time_to_target_s == pytest.approx(4.0)
    assert rows["powersgd-r2"].vs_torch == pytest.approx(1 / 3)
    assert rows["powersgd-r1-noef"].time_to_target_s is None and rows["powersgd-r1-noef"].vs_torch is None
    assert rows["powersgd-r2"].final_metric == pytest.approx(0.9475)
    assert rows["powersgd-r2"].within_tolerance is True  # 0.9475 >= 0.95 - 0.01
    assert rows["powersgd-r1-noef"].within_tolerance is False
    assert rows["allreduce"].bytes_per_step == 1000.0 and rows["powersgd-r2"].step_ms == pytest.approx(100.0)
    assert accuracy_verdicts(list(rows.values())) == {
        "torch-ddp": True, "allreduce": True, "powersgd-r2": True, "powersgd-r1-noef": False,
    }  # fmt: skip
    tighter = {r.name: r for r in summarize_runs(contenders, RUNS, target, "max", 0.001)}
    assert tighter["powersgd-r2"].within_tolerance is False


def test_convergence_recommendation_needs_accuracy_within_tolerance() -> None:
    contenders = convergence_contenders_named(list(RUNS))
    target = default_target(RUNS, "max", 0.01)
    advice = recommend_from_convergence(
        summarize_runs(contenders, RUNS, target, "max", 0.01), "val_acc", 0.01
    )
    assert advice.startswith("Recommended: powersgd-r2 -> DDPXStrategy(comm_hook='powersgd'")
    assert "0.33x allreduce's time" in advice
    assert "Outside tolerance, not recommended: powersgd-r1-noef (val_acc 0.8250 vs 0.9500)" in advice
    strict = recommend_from_convergence(
        summarize_runs(contenders, RUNS, target, "max", 0.001), "val_acc", 0.001
    )
    assert strict.startswith("Recommended: allreduce -> DDPXStrategy()")
    no_reference = {k: v for k, v in RUNS.items() if k not in ("allreduce", "torch-ddp")}
    rows = summarize_runs(convergence_contenders_named(list(no_reference)), no_reference, 0.9, "max", 0.01)
    assert "could not be checked" in recommend_from_convergence(rows, "val_acc", 0.01)


def test_step_time_recommendation_takes_a_lossy_hook_only_when_its_accuracy_was_checked() -> None:
    times = {"torch-ddp": 100, "allreduce": 100, "fp16": 60, "bf16": 62, "powersgd-r1": 30,
             "powersgd-r2": 40, "powersgd-r4": 45, "batched-r1": 35, "noop": 20}  # fmt: skip
    rows = [_row(name, ms) for name, ms in times.items()]
    unchecked = recommend(CONTENDERS, rows)
    assert unchecked.startswith("Recommended: allreduce -> DDPXStrategy()")
    assert "powersgd-r1 is faster (3.33x) but its accuracy on this model could not be checked" in unchecked
    assert "--accuracy-from" in unchecked
    checked = recommend(CONTENDERS, rows, {"powersgd-r2": True, "powersgd-r1": False, "fp16": True})
    assert checked.startswith('Recommended: powersgd-r2 -> DDPXStrategy(comm_hook="powersgd"')
    assert "2.50x faster than allreduce" in checked
    assert "powersgd-r1 is faster (1.33x) but lost accuracy beyond the tolerance" in checked


def test_accuracy_verdicts_read_back_from_a_convergence_json(tmp_path: Any) -> None:
    path = os.path.join(tmp_path, "conv.json")
    with open(path, "w") as f:
        json.dump({"accuracy": {"powersgd-r2": True, "fp16": False}}, f)
    assert load_accuracy_verdicts(path) == {"powersgd-r2": True, "fp16": False}
    with open(path, "w") as f:
        json.dump({"rows": []}, f)
    with pytest.raises(SystemExit, match="not a --convergence result"):
        load_accuracy_verdicts(path)


def test_contender_names_are_checked_and_post_local_sgd_waits_for_its_hook() -> None:
    names = [c.name for c in convergence_contenders_named(None)]
    assert names[:3] == ["torch-ddp", "allreduce", "fp16"] and "powersgd-r4-noef" in names
    with pytest.raises(ValueError, match=r"unknown contender\(s\) \['powersgd-r3'\]"):
        convergence_contenders_named(["powersgd-r3"])
    noef = convergence_contenders_named(["powersgd-r2-noef"])[0]
    assert noef.strategy["powersgd"]["use_error_feedback"] is False and noef.lossy
    if "post-local-sgd" not in names:
        with pytest.raises(ValueError, match="needs the post_local_sgd hook"):
            convergence_contenders_named(["post-local-sgd"])


def test_built_in_tasks_ship_their_data() -> None:
    digits = DigitsUpscaled()
    digits.setup("fit")
    x, y = digits.train_set[:4]
    assert x.shape == (4, 1, 16, 16) and 0.0 <= x.min() and x.max() <= 1.0
    assert len(digits.train_set) + len(digits.val_set) == 1797
    assert DigitsCNN()(x).shape == (4, 10)
    tokens = pydoc_tokens()
    assert len(tokens) > 90_000 and tokens.count("the") > 2000  # real English
    text = PydocText(context=8, vocab=512)
    text.setup("fit")
    inputs, targets = text.train_set[0]
    assert torch.equal(inputs[1:], targets[:-1]) and int(inputs.max()) < 512


# -------------------------------------------------------------------------------- end-to-end smoke runs
class TinyModule(DigitsCNN):
    """A user's LightningModule, as ``--model tests.bench.test_bench_convergence:TinyModule`` imports it."""

    def __init__(self) -> None:
        super().__init__(hidden=16, lr=0.1)


class TinyData(LightningDataModule):
    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.rand(128, 1, 16, 16, generator=generator)
        self.data = TensorDataset(x, (x.mean((1, 2, 3)) > 0.5).long())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=64)


@pytest.mark.slow
@pytest.mark.processes
def test_convergence_mode_trains_a_users_module_per_contender(tmp_path: Any) -> None:
    json_path, png_path = os.path.join(tmp_path, "c.json"), os.path.join(tmp_path, "c.png")
    done = run_job([
        sys.executable, "-m", "lightning_ddpx.bench", "--convergence",
        "--model", "tests.bench.test_bench_convergence:TinyModule", "--datamodule", "tests.bench.test_bench_convergence:TinyData",
        "--hooks", "powersgd-r1", "--max-steps", "4", "--val-every", "2",
        "--json", json_path, "--png", png_path,
    ], timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with open(json_path) as f:
        result = json.load(f)
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["powersgd-r1"] and rows["powersgd-r1"]["steps"] == 4
    assert [p["step"] for p in result["runs"]["powersgd-r1"]["val"]] == [2, 4]
    gradient_bytes = 4 * sum(p.numel() for p in TinyModule().parameters())
    assert rows["powersgd-r1"]["bytes_per_step"] == gradient_bytes  # 4 steps < start_powerSGD_iter: allreduce
    assert rows["powersgd-r1"]["within_tolerance"] is None  # no lossless run to compare with
    assert "could not be checked" in result["recommendation"]
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.processes
def test_bench_convergence_quick_run_writes_table_and_plot(tmp_path: Any) -> None:
    done = run_job([
        sys.executable, "benchmarks/bench_convergence.py", "--quick", "--tasks", "digits",
        "--hooks", "allreduce", "--out", str(tmp_path),
    ], timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with open(os.path.join(tmp_path, "digits_loopback.json")) as f:
        saved = json.load(f)
    assert set(saved["runs"]) == {"allreduce"} and saved["max_steps"] == 8
    assert [p["step"] for p in saved["runs"]["allreduce"]["val"]] == [4, 8]
    assert saved["accuracy"]["allreduce"] is True
    with open(os.path.join(tmp_path, "digits.md")) as f:
        assert "final val_acc" in f.read()
    with open(os.path.join(tmp_path, "convergence_digits.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_convergence_arguments_are_checked_before_any_process_starts(capsys: Any) -> None:
    from lightning_ddpx.bench.cli import parse_args

    args = parse_args(["--convergence", "--model", "digits", "--hooks", "allreduce,powersgd-r4-noef"])
    assert args.hooks == ["allreduce", "powersgd-r4-noef"] and args.max_steps == 200
    assert parse_args(["--convergence", "--model", "digits"]).hooks == DEFAULT_CONTENDERS.split(",")
    for extra, expected in (
        (["--max-steps", "10", "--val-every", "10"], "at least two validations"),
        (["--hooks", "powersgd-r3"], "unknown contender(s) ['powersgd-r3']"),
        (["--tolerance", "-0.1"], "--tolerance must be >= 0"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--convergence", "--model", "digits", *extra])
        assert expected in capsys.readouterr().err, extra
