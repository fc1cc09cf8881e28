"""Keep the benchmarks from rotting: their statistics, their models, and one tiny end-to-end run.

The benchmarks are run by hand, rarely, on a quiet machine; without a test an API change in the package or
a typo in a code path only they use would go unnoticed until the day someone needs the numbers.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import random
import subprocess
import sys

import pytest
import torch

from benchmarks.common import (
    MODELS,
    build_model,
    interleaved_timing,
    parameter_summary,
    percentile,
    summarize_pair,
    verdict,
)
from lightning_ddpx.bench.timing import RatioInterval, median_interval, ratio_interval, rotated, round_ratios
from tests.dist_utils import run_job


def run_benchmark(script: str, *arguments: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> <arguments>``; it must succeed."""
    completed = run_job([sys.executable, os.path.join("benchmarks", script), *arguments], timeout=timeout)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 25) == pytest.approx(1.75)
    assert percentile([7.0], 75) == 7.0


def test_summarize_pair_uses_same_round_ratios() -> None:
    # The machine slows down 3x half-way: ratios of same-round pairs stay at 1.1 regardless.
    baseline = [0.010, 0.010, 0.030, 0.030]
    candidate = [0.011, 0.011, 0.033, 0.033]
    summary = summarize_pair(baseline, candidate)
    assert summary.ratio == pytest.approx(1.1)
    assert summary.ratio_p25 == pytest.approx(1.1) and summary.ratio_p75 == pytest.approx(1.1)
    assert summary.baseline_ms == pytest.approx(20.0) and summary.candidate_ms == pytest.approx(22.0)
    assert summary.pairs == 4
    with pytest.raises(ValueError):
        summarize_pair([0.1], [0.1, 0.2])


def test_median_interval_is_the_sign_test_interval_and_covers_the_median() -> None:
    # n = 100: k = floor(50 - 1.96 * 10 / 2) = 40, so the 40th smallest and the 40th largest values.
    assert median_interval([float(v) for v in range(1, 101)]) == (40.0, 61.0)
    low, high = median_interval([1.0] * 5)
    assert low != low and high != high  # nan: five values cannot carry a 95 % interval
    summary = summarize_pair([1.0] * 50, [1.0 + 0.01 * k for k in range(50)])  # ratios 1.00 .. 1.49
    assert summary.ratio_ci_low < summary.ratio < summary.ratio_ci_high
    assert (summary.ratio_ci_low, summary.ratio_ci_high) == pytest.approx((1.17, 1.32))


def _interleaved_run(rounds: int, block: int, ratio: float, rng: random.Random) -> tuple[list, list]:
    """Synthetic step times as interleaved_timing lists them: the machine's speed drifts from round to round
    (shared by both contenders within a round, as interleaving intends), every step has its own noise, and
    now and then (5 % of rounds) one contender's side of a round is hit by another job and takes 3x."""
    baseline, candidate = [], []
    for _ in range(rounds):
        speed = math.exp(rng.gauss(0, 0.3))
        hit = rng.random()
        slow_base, slow_cand = (3.0 if hit < 0.025 else 1.0), (3.0 if 0.025 <= hit < 0.05 else 1.0)
        baseline += [0.01 * speed * slow_base * math.exp(rng.gauss(0, 0.05)) for _ in range(block)]
        candidate += [0.01 * ratio * speed * slow_cand * math.exp(rng.gauss(0, 0.05)) for _ in range(block)]
    return baseline, candidate


def test_round_ratios_compare_the_sums_of_each_round() -> None:
    assert round_ratios([1.0, 1.0, 2.0, 2.0, 4.0], [2.0, 2.0, 2.0, 2.0, 2.0], 2) == [2.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="block"):
        round_ratios([1.0], [1.0], 0)
    with pytest.raises(ValueError):
        round_ratios([1.0], [1.0, 2.0], 1)


def test_ratio_interval_covers_the_true_ratio_and_narrows_with_rounds() -> None:
    rng = random.Random(0)
    true_ratio = 1.05  # the median round's ratio (hits fall on either side alike)
    covered, widths = 0, {}
    for rounds in (40, 160, 640):
        runs = [ratio_interval(*_interleaved_run(rounds, 5, true_ratio, rng), block=5) for _ in range(100)]
        assert all(r.rounds == rounds for r in runs)
        covered += sum(r.low <= true_ratio <= r.high for r in runs)
        widths[rounds] = sorted(r.half_width for r in runs)[50]
    assert covered >= 0.92 * 300, covered  # a 95 % interval (the sign test's is slightly conservative)
    # the width goes as 1/sqrt(rounds): four times the rounds, half the width
    assert widths[160] == pytest.approx(widths[40] / 2, rel=0.25)
    assert widths[640] == pytest.approx(widths[160] / 2, rel=0.25)
    assert widths[640] < 0.01  # per-step noise of 5 %: 640 rounds of 5 steps resolve the ratio to +-1 %


def test_ratio_interval_treats_a_round_not_a_step_as_one_sample() -> None:
    """Steps of one round share that round's conditions: 50 rounds of 20 steps resolve the ratio no better
    than 50 rounds of 1, because what varies independently is the round."""
    rng = random.Random(1)

    def run(block: int) -> tuple[list, list]:
        baseline, candidate = [], []
        for _ in range(50):
            speed, side = math.exp(rng.gauss(0, 0.3)), math.exp(rng.gauss(0, 0.05))  # a round's drift
            baseline += [0.01 * speed] * block
            candidate += [0.01 * speed * side] * block
        return baseline, candidate

    long_blocks = sorted(ratio_interval(*run(20), block=20).half_width for _ in range(40))[20]
    short_blocks = sorted(ratio_interval(*run(1), block=1).half_width for _ in range(40))[20]
    assert long_blocks == pytest.approx(short_blocks, rel=0.3)
    assert ratio_interval(*run(20), block=20).rounds == 50


def test_a_target_is_met_when_the_intervals_upper_end_is_under_it() -> None:
    assert RatioInterval(median=1.00, low=0.98, high=1.005, rounds=60).verdict(1.01) == "PASS"
    assert RatioInterval(median=1.00, low=0.98, high=1.02, rounds=60).verdict(1.01) == "UNRESOLVED"
    assert RatioInterval(median=0.99, low=0.97, high=1.01, rounds=60).verdict(1.01) == "UNRESOLVED"
    assert RatioInterval(median=1.05, low=1.01, high=1.08, rounds=60).verdict(1.01) == "MISS"
    assert RatioInterval(median=3.00, low=2.0, high=4.0, rounds=60).verdict(None) == "-"
    nan = float("nan")
    assert RatioInterval(median=0.90, low=nan, high=nan, rounds=3).verdict(1.01) == "UNRESOLVED"  # too few
    assert RatioInterval(median=1.0, low=0.98, high=1.02, rounds=60).half_width == pytest.approx(0.02)


def test_interleaved_timing_also_records_cpu_time_per_step() -> None:
    def spin() -> None:  # CPU work, so that CPU time is above zero
        sum(range(20000))

    cpu: dict[str, list[float]] = {}
    faults: dict[str, list[int]] = {}

    def touch_fresh_memory() -> None:  # 4 MiB from the system, every page written: a fault per page
        pages = mmap.mmap(-1, 4 << 20)
        pages.write(b"x" * (4 << 20))
        pages.close()

    steps = {"a": spin, "b": touch_fresh_memory}
    wall = interleaved_timing(
        steps, timed_steps=4, warmup_steps=0, block=2, cpu_times=cpu, page_faults=faults
    )
    assert [len(cpu["a"]), len(cpu["b"])] == [4, 4] and [len(faults["a"]), len(faults["b"])] == [4, 4]
    assert min(faults["b"]) >= 1 and sum(faults["b"]) > sum(faults["a"])  # 4 KiB pages: 1024 a step
    assert all(c > 0 for c in cpu["a"])
    assert all(c <= w * 1.5 + 1e-3 for c, w in zip(cpu["a"], wall["a"]))  # one busy thread: CPU ~ wall


def test_verdict() -> None:
    assert verdict(1.0, 1.0) == "PASS"
    assert verdict(1.06, 1.05) == "MISS"
    assert verdict(3.0, None) == "-"


def test_interleaved_timing_rotates_order_and_warms_up() -> None:
    calls: list[str] = []
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    rounds: list[int] = []
    times = interleaved_timing(
        steps, timed_steps=3, warmup_steps=1, block=2, on_block=lambda r, n, t: rounds.append(r)
    )
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "a"]  # warm-up, round 0, round 1 reversed
    assert [len(times["a"]), len(times["b"])] == [3, 3]
    assert rounds == [0, 1]
    calls.clear()
    three = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    interleaved_timing(three, timed_steps=3, warmup_steps=0, block=1)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each contender in each position once
    assert rotated(("plain", "torch", "ours"), 4) == ["torch", "ours", "plain"]  # bench_per_parameter's order


def test_models_have_the_documented_shape() -> None:
    """The brief each model stands for: sizes that decide where step time goes."""
    tensors, numel = parameter_summary(build_model("mlp"))
    assert tensors == 10 and 19e6 < numel < 22e6
    tensors, numel = parameter_summary(build_model("many"))
    assert 290 <= tensors <= 310 and 1.8e6 < numel < 2.3e6
    encoder = build_model("transformer")
    assert len(encoder.encoder.layers) == 4 and encoder.encoder.layers[0].self_attn.embed_dim == 256
    assert MODELS["transformer"].input_shape == (8, 128, 256)
    assert MODELS["mlp"].input_shape[0] == 32


@pytest.mark.slow
@pytest.mark.processes
def test_engine_benchmark_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "bench.json"
    completed = run_benchmark(
        "bench_engine.py",
        "--models", "tiny", "--steps", "2", "--warmup", "2", "--block", "1", "--quiet", "--json", str(out),
    )  # fmt: skip
    assert "ratio" in completed.stdout and "tiny" in completed.stdout
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert len(tiny["torch_ms"]) == len(tiny["ours_ms"]) == 2
    assert tiny["param_max_abs_diff"] == 0.0  # both modules did bit-identical work
    assert tiny["summary"]["ratio"] > 0


@pytest.mark.slow
@pytest.mark.processes
def test_engine_benchmark_times_a_snapshot_and_an_injected_transport(tmp_path) -> None:
    """Before/after runs: the package at a commit (here HEAD) as a contender, three ranks, and ours with the
    halves transport injected (the benchmark's alternative, never a switch on the engine)."""
    snapshot = run_benchmark("snapshot_package.py", "HEAD", str(tmp_path))
    assert snapshot.stdout.strip().endswith("lightning_ddpx_before")
    out = tmp_path / "bench.json"
    completed = run_benchmark(
        "bench_engine.py", "--models", "tiny", "--steps", "2", "--warmup", "2", "--block", "1", "--quiet",
        "--world-size", "3", "--before", str(tmp_path), "--halves", "--gloo", "--json", str(out),
    )  # fmt: skip
    assert (
        "before/torch" in completed.stdout
        and "halves/ours" in completed.stdout
        and "gloo/ours" in completed.stdout
    )
    results = json.loads(out.read_text())
    assert len(results["before"]["tiny"]["before_ms"]) == len(results["halves"]["tiny"]["halves_ms"]) == 2
    assert results["models"]["tiny"]["param_max_abs_diff"] == 0.0  # all contenders did the same arithmetic


@pytest.mark.slow
@pytest.mark.processes
def test_hooks_benchmark_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "hooks.json"
    completed = run_benchmark("bench_hooks.py", "--quick", "--json", str(out))
    assert "ours-powersgd-r1 / torch-powersgd-r1" in completed.stdout
    tiny = json.loads(out.read_text())["models"]["tiny"]
    contenders = tiny["contenders"]
    assert len(contenders) == 10 and all(len(c["step_ms"]) == 2 for c in contenders.values())
    # The warm-up went past start_powerSGD_iter: every timed PowerSGD step was a compressed one.
    for name in ("torch-powersgd-r1", "ours-powersgd-r1", "ours-powersgd-r4", "ours-batched-r1"):
        assert contenders[name]["powersgd"]["first_timed_iter"] >= 2, name
        assert contenders[name]["buckets"] in (1, None), name
    assert contenders["ours-powersgd-r1"]["powersgd"]["compression_rate"] > 1.0
    assert tiny["param_max_abs_diff"]["torch-allreduce vs ours-allreduce"] == 0.0
    assert [t["candidate"] for t in tiny["targets"]] == ["ours-powersgd-r1", "ours-fp16", "ours-bf16"]
    assert all(t["summary"]["ratio"] > 0 for t in tiny["targets"])


@pytest.mark.slow
@pytest.mark.processes
def test_stats_benchmark_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "stats.json"
    run_benchmark(
        "bench_stats.py",
        "--models",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "2",
        "--block",
        "1",
        "--json",
        str(out),
    )
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert len(tiny["times_s"]["stats-on"]) == len(tiny["times_s"]["stats-off"]) == 2
    assert tiny["stats_on_last_step"]["bytes_sent"] == tiny["stats_on_last_step"]["bytes_to_hook"] > 0


@pytest.mark.slow
@pytest.mark.processes
def test_compile_benchmark_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "compile.json"
    run_benchmark(
        "bench_compile.py", "--models", "tiny",
        "--backend", "aot_eager", "--steps", "2", "--warmup", "3", "--block", "1", "--bucket-cap-mb", "0.0002",
        "--quiet", "--json", str(out), timeout=240,
    )  # fmt: skip
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert all(len(tiny["step_ms"][c]) == 2 for c in ("eager", "whole", "split"))
    assert tiny["split_vs_whole"]["ratio"] > 0


@pytest.mark.processes
def test_per_parameter_benchmark_runs_end_to_end() -> None:
    completed = run_benchmark("bench_per_parameter.py", "--models", "tiny", "--rounds", "4", "--block", "1")
    row = next(line for line in completed.stdout.splitlines() if line.startswith("tiny"))
    assert int(row.split()[1]) == 4  # tensors of the tiny model
    completed = run_benchmark(
        "bench_per_parameter.py",
        "--models",
        "tiny",
        "--rounds",
        "4",
        "--block",
        "1",
        "--gradient-as-bucket-view",
    )
    assert "gradient_as_bucket_view=True" in completed.stdout
    completed = run_benchmark("bench_per_parameter.py", "--models", "tiny", "--rounds", "4", "--hook-floor")
    row = next(line for line in completed.stdout.splitlines() if line.startswith("tiny"))
    assert "accumulator-hook" in row and "tensor-hook" in row


@pytest.mark.parametrize("kind", ["accumulator-hook", "tensor-hook"])
def test_hook_floor_contenders_run_their_hook_once_per_gradient(kind: str, monkeypatch) -> None:
    """The hook-floor contenders measure a hook that backward really calls, once per parameter per backward
    (an accumulator nobody held would be made anew at each backward, without the hook)."""
    from benchmarks import bench_per_parameter

    calls: list[int] = []
    monkeypatch.setattr(bench_per_parameter, "_ignore", lambda *args: calls.append(1))
    model = bench_per_parameter.with_noop_hooks(build_model("tiny"), kind)
    for _ in range(2):
        model(torch.randn(MODELS["tiny"].input_shape)).sum().backward()
    assert len(calls) == 2 * len(list(model.parameters()))


@pytest.mark.processes
def test_overlap_benchmark_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "overlap.json"
    completed = run_benchmark(
        "bench_overlap_optimizer.py",
        "--models", "tiny", "--steps", "2", "--warmup", "2", "--block", "1", "--compare-unsliced",
        "--json", str(out),
    )  # fmt: skip
    assert "overlap, every parameter whole" in completed.stdout
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert set(tiny["times_s"]) == {"torch", "ours", "overlap", "overlap_whole"}
    assert all(len(times) == 2 for times in tiny["times_s"].values())
    assert tiny["max_diff_overlap_vs_torch"] <= 1e-6
    assert set(tiny["exposed_update_ms"]) == {"overlap", "overlap_whole"}


@pytest.mark.processes
def test_slices_benchmark_runs_end_to_end() -> None:
    completed = run_benchmark("bench_slices.py", "--repeats", "1")
    assert "bit-identical" in completed.stdout and "AdamW" in completed.stdout
    assert "16 chunks" in completed.stdout


@pytest.mark.processes
def test_collectives_benchmark_runs_end_to_end() -> None:
    completed = run_benchmark("bench_collectives.py", "--sizes-mb", "0.01", "--repeats", "1")
    assert "halves" in completed.stdout and "0.0 MB" in completed.stdout
    assert "shared memory" in completed.stdout  # the engine's own two-rank path, on one machine


@pytest.mark.slow
@pytest.mark.processes
def test_replica_check_benchmark_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "replica.json"
    run_benchmark(
        "bench_replica_check.py", "--models", "tiny", "--rounds", "2", "--warmup", "1", "--json", str(out)
    )
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert set(tiny["cost_share"]) == {"1", "10", "100"} and tiny["median_s"]["verify"] > 0


@pytest.mark.slow
@pytest.mark.processes
def test_step_phases_benchmark_prints_each_wrappers_extra_time_per_phase() -> None:
    completed = run_benchmark(
        "bench_step_phases.py", "--models", "tiny300", "--rounds", "2", "--block", "1", "--without", "scale",
    )  # fmt: skip
    lines = completed.stdout.splitlines()
    assert "ours without: scale" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [row[:2] for row in rows] == [["tiny300", "torch"], ["tiny300", "ours"]]
    assert all(len(row) == 7 for row in rows)  # four phases and the total, in microseconds


def test_rounds_needed_scales_the_rounds_by_the_square_of_the_width(tmp_path) -> None:
    from benchmarks.rounds_needed import analyse, rounds_needed

    assert rounds_needed(20, 0.04) == 80  # twice the width asked for: four times the rounds
    assert rounds_needed(150, 0.02) == 150
    rng = random.Random(2)
    torch_s, ours_s = _interleaved_run(40, 5, 0.9, rng)
    path = tmp_path / "engine.json"
    results = {
        "config": {"block": 5},
        "environment": {"cpu_count": 2, "loadavg": [1.0, 1.0, 1.0], "time": "2026-12-02 00:00:00 +0000"},
        "models": {"mlp": {"torch_ms": [1e3 * t for t in torch_s], "ours_ms": [1e3 * t for t in ours_s]}},
    }
    path.write_text(json.dumps(results))
    mlp = analyse(str(path))["models"]["mlp"]
    assert mlp["ratio"] == pytest.approx(vars(ratio_interval(torch_s, ours_s, 5)))  # ms or s: the same ratio
    assert mlp["rounds_for_2_percent"] == rounds_needed(40, mlp["half_width"])
