"""``python -m lightning_ddpx.bench``: end to end on a tiny model (loopback), and its recommendation logic."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch import nn

from lightning_ddpx.bench.contenders import contenders_named
from lightning_ddpx.bench.report import Row, recommend
from tests.dist_utils import run_job


def factory() -> tuple[nn.Module, torch.Tensor]:
    """A user's model factory as the bench imports it: ``tests.bench.test_bench_cli:factory``."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)


GRADIENT_BYTES = 4 * (8 * 16 + 16 + 16 * 4 + 4)


@pytest.mark.slow
@pytest.mark.processes
def test_bench_runs_end_to_end_and_writes_json_and_chart(tmp_path: os.PathLike) -> None:
    json_path, png_path = os.path.join(tmp_path, "bench.json"), os.path.join(tmp_path, "bench.png")
    command = [
        sys.executable, "-m", "lightning_ddpx.bench", "--model", "tests.bench.test_bench_cli:factory",
        "--steps", "2", "--warmup", "3", "--block", "1",
        "--hooks", "torch-ddp,allreduce,fp16,powersgd-r1,noop", "--json", json_path, "--png", png_path,
    ]  # fmt: skip
    done = run_job(command, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "round 2/2" in done.stdout  # progress is shown while it runs
    assert "Recommended:" in done.stdout
    with open(json_path) as f:
        result = json.load(f)
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["torch-ddp", "allreduce", "fp16", "powersgd-r1", "noop"]
    assert rows["allreduce"]["bytes_sent"] == GRADIENT_BYTES
    assert rows["torch-ddp"]["bytes_sent"] == GRADIENT_BYTES
    assert rows["fp16"]["bytes_sent"] == GRADIENT_BYTES / 2
    assert rows["noop"]["bytes_sent"] == 0
    assert rows["allreduce"]["vs_allreduce"] == 1.0
    assert all(row["median_ms"] > 0 for row in rows.values())
    assert result["recommendation"].startswith("Recommended: ")
    assert len(result["step_times_s"]["fp16"]) == 2
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.processes
def test_bad_arguments_fail_before_any_process_starts() -> None:
    for extra, expected in (
        (["--model", "no_such_module:build"], "cannot import it"),
        (["--model", "tiny", "--hooks", "allreduce,fastest"], "unknown contender(s) ['fastest']"),
        (["--model", "tiny", "--warmup", "1"], "--warmup must be > 2"),
    ):
        done = run_job([sys.executable, "-m", "lightning_ddpx.bench", *extra], timeout=60)
        assert done.returncode != 0 and expected in done.stderr, (extra, done.stderr)


def _row(name: str, median_ms: float) -> Row:
    contender = contenders_named([name])[0]
    return Row(name, median_ms, median_ms, median_ms, None, None, None,
               contender.accuracy_cost, contender.accuracy_note, contender.strategy_arguments())  # fmt: skip


def test_recommendation_keeps_allreduce_when_compression_saves_little() -> None:
    times = {"allreduce": 100, "fp16": 97, "bf16": 99, "powersgd-r2": 130, "noop": 92}
    advice = recommend(contenders_named(list(times)), [_row(n, ms) for n, ms in times.items()])
    assert advice.startswith("Recommended: allreduce -> DDPXStrategy()")
    assert "compression does not pay here" in advice and "1.09x faster" in advice
