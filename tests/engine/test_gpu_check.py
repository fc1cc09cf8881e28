"""scripts/gpu_check.sh on a machine without a GPU: it says what it skipped and exits 0; its --dry-run runs
the cuda tests' collection and the GPU benchmark's own code on the CPU (tiny models), so neither rots
between the runs on a GPU; a part that fails or runs out of time fails the check."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.dist_utils import job_env, run_job

SCRIPT = ["bash", "scripts/gpu_check.sh"]
no_gpu_here = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the script's behaviour without a GPU"
)


@no_gpu_here
@pytest.mark.processes
def test_without_a_gpu_it_says_what_it_skipped_and_exits_0():
    done = run_job(SCRIPT, timeout=120, env=job_env(DDPX_PYTHON=sys.executable))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA GPU here" in done.stdout
    assert "skipped (a) the cuda-marked tests" in done.stdout and "(b) the GPU benchmark" in done.stdout


@pytest.mark.slow
@pytest.mark.processes
def test_dry_run_runs_the_cpu_side_of_every_part(tmp_path):
    done = run_job([*SCRIPT, "--dry-run", "--results-dir", str(tmp_path)], timeout=300,
                   env=job_env(DDPX_PYTHON=sys.executable))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu_check: ok" in done.stdout
    assert "dry run, no GPU used: skipped" in done.stdout
    summary = done.stdout.split("=== gpu_check summary", 1)[1]
    assert "(a) cuda-marked tests" in summary and "skipped" in summary  # collected, and skipped
    for setup in ("nccl_ws1", "gloo_2ranks"):
        result = json.loads((tmp_path / f"gpu_dryrun_{setup}.json").read_text())
        assert result["device"] == "cpu" and result["backend"] == "gloo"
        assert sorted(result["models"]) == ["gpt2", "lm", "mlp", "resnet50"]
        for name, model in result["models"].items():
            assert model["summary"]["pairs"] == 2 and model["summary"]["ratio"] > 0
            assert model["cpu_summary"]["pairs"] == 2 and model["cpu_summary"]["candidate_ms"] > 0
            assert model["free_running"] == (10 if name in ("lm", "mlp") else 0)
            assert model["ours_buckets"] >= 1
            # the profiler found our reducer's labels: the host-overhead code path ran
            assert model["overhead"]["launch_us_per_bucket"] > 0
            # GPU-only figures are absent on the CPU, and no verdict is given on tiny CPU models
            assert model["host_syncs_per_step"] == {"torch": None, "ours": None}
            assert model["extra_peak_in_buckets"] is None and model["result"] == "-"


@pytest.mark.slow
@pytest.mark.processes
def test_a_part_out_of_time_fails_the_check(tmp_path):
    env = job_env(DDPX_PYTHON=sys.executable, DDPX_GPU_TESTS_TIMEOUT_S="1", DDPX_GPU_BENCH_TIMEOUT_S="1")
    done = run_job([*SCRIPT, "--dry-run", "--results-dir", str(tmp_path)], timeout=120, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "TIMED OUT" in done.stdout and "gpu_check: FAILED" in done.stdout


def test_the_summary_tables_peak_memory_column_gives_ours_then_torchs_as_its_header_says():
    from benchmarks.bench_gpu import HEADERS, table_rows

    result = {
        "summary": {"baseline_ms": 10.0, "candidate_ms": 10.5, "ratio": 1.05},
        "ratio": {"median": 1.05, "low": 1.01, "high": 1.09, "rounds": 40},
        "cpu_summary": {"baseline_ms": 9.0, "candidate_ms": 9.5, "ratio": 1.06},
        "before": {"ours_vs_before": {"ratio": 0.9}},
        "target_ratio": None,
        "result": "-",
        "overhead": {"host_us_per_bucket": 12.0},
        "host_syncs_per_step": {"ours": 0.0, "torch": 1.0},
        "memory": {"ours": {"peak_bytes": 300 * 2**20}, "torch": {"peak_bytes": 200 * 2**20}},
        "extra_peak_in_buckets": 0.5,
    }
    (row,) = table_rows("nccl_ws1", {"gpt2": result})
    cells = dict(zip(HEADERS, row))
    assert cells["peak MiB ours / torch"] == "300 / 200"
    assert cells["syncs/step ours / torch"] == "0.0 / 1.0"
    assert (cells["torch ms"], cells["ours ms"]) == ("10.0", "10.5")
    assert cells["CPU ms/step torch / ours"] == "9.00 / 9.50"
    assert cells["ours/before"] == "0.900"
    assert cells["ratio (95 %)"] == "1.050 (1.010-1.090)"  # the headline: ratio_interval, as bench_engine
