"""benchmarks/bench_host_cost.py: its cost model on synthetic step times, and one quick end-to-end run."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from benchmarks.bench_host_cost import Layout, analyse, fit_costs, layouts_from, ratio_of_medians
from tests.dist_utils import run_job

LAYOUTS = layouts_from((16, 128), (1, 16, 64))
TENSORS = {16: 32, 128: 256}


def test_fit_recovers_per_gradient_and_per_bucket_costs() -> None:
    tensors, buckets = [32, 256, 256, 256], [1, 1, 16, 64]
    extra = [100 + 6 * t + 40 * b for t, b in zip(tensors, buckets)]
    assert fit_costs(tensors, buckets, extra) == pytest.approx((100, 6, 40))


def test_fit_refuses_layouts_that_cannot_separate_the_costs() -> None:
    # every layout has as many buckets as tensors / 32: per gradient and per bucket always move together
    with pytest.raises(ValueError, match="cannot separate"):
        fit_costs([32, 64, 128], [1, 2, 4], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="one tensor count"):
        fit_costs([32, 256], [1, 1, 16], [1.0, 2.0, 3.0])


def test_analyse_reads_costs_out_of_round_aligned_step_times() -> None:
    """Synthetic step times, in seconds, two steps a round: the plain chains, torch's DDP at 10 us per
    gradient and 30 us per bucket, ours at 5 and 120; the machine gets twice as slow for plain steps half-way,
    and the wrappers' extras stay the same, so every round gives the same fit."""
    assert [layout.name for layout in LAYOUTS] == ["16x1", "128x1", "128x16", "128x64"]
    rounds, block = 8, 2
    plain = {16: 1e-3, 128: 6e-3}
    cost = {"torch": (200e-6, 10e-6, 30e-6), "ours": (100e-6, 5e-6, 120e-6)}
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        slow = 1.0 if r < rounds // 2 else 2.0
        for layers, seconds in plain.items():
            times.setdefault(f"plain/{layers}", []).extend([slow * seconds] * block)
        for layout in LAYOUTS:
            for wrapper, (fixed, gradient, bucket) in cost.items():
                extra = fixed + gradient * TENSORS[layout.layers] + bucket * layout.buckets
                step = slow * plain[layout.layers] + extra
                times.setdefault(f"{wrapper}/{layout.name}", []).extend([step] * block)
    buckets = {layout.name: {"torch": layout.buckets, "ours": layout.buckets} for layout in LAYOUTS}
    result = analyse(times, LAYOUTS, TENSORS, buckets, block)
    costs = result["costs"]
    assert result["rounds"] == rounds
    assert costs["per_gradient"]["torch"]["median"] == pytest.approx(10.0)
    assert costs["per_gradient"]["ours"]["median"] == pytest.approx(5.0)
    assert costs["per_bucket"]["torch"]["median"] == pytest.approx(30.0)
    assert costs["per_bucket"]["ours"]["median"] == pytest.approx(120.0)
    assert costs["per_bucket"]["ours_minus_torch"]["median"] == pytest.approx(90.0)
    assert costs["per_bucket"]["ratio"]["median"] == pytest.approx(4.0)
    assert costs["fixed"]["ours"]["median"] == pytest.approx(100.0)
    many = result["layouts"]["128x64"]
    assert many["ours_extra_us"]["median"] == pytest.approx(100 + 5 * 256 + 120 * 64)
    assert many["plain_us"] == pytest.approx(1.5 * 6000)  # median of 6 ms and 12 ms rounds


def test_analyse_compares_ours_with_the_package_before_a_change() -> None:
    """``--before``: a third wrapper, fitted like the others, and ours compared with it (ours / before)."""
    block = 2
    cost = {"torch": (200e-6, 10e-6, 30e-6), "ours": (100e-6, 5e-6, 60e-6), "before": (100e-6, 5e-6, 120e-6)}
    times: dict[str, list[float]] = {}
    for r in range(6):
        for layers in TENSORS:
            times.setdefault(f"plain/{layers}", []).extend([1e-3 * (1 + r % 2)] * block)
        for layout in LAYOUTS:
            for wrapper, (fixed, gradient, bucket) in cost.items():
                extra = fixed + gradient * TENSORS[layout.layers] + bucket * layout.buckets
                times.setdefault(f"{wrapper}/{layout.name}", []).extend([1e-3 * (1 + r % 2) + extra] * block)
    buckets = {layout.name: {w: layout.buckets for w in cost} for layout in LAYOUTS}
    result = analyse(times, LAYOUTS, TENSORS, buckets, block, ("torch", "ours", "before"))
    per_bucket = result["costs"]["per_bucket"]
    assert per_bucket["before"]["median"] == pytest.approx(120.0)
    assert per_bucket["ours_minus_before"]["median"] == pytest.approx(-60.0)
    assert per_bucket["ratio_before"]["median"] == pytest.approx(0.5)
    assert per_bucket["ratio"]["median"] == pytest.approx(2.0)  # ours / torch, as without --before
    assert result["layouts"]["128x64"]["step_ratio_before"]["median"] < 1


def test_ratio_of_medians_has_a_bootstrap_interval_around_it() -> None:
    torch_costs = [30.0 + (k % 5) for k in range(40)]
    ours = [4 * c for c in torch_costs]
    exact = ratio_of_medians(ours, torch_costs)
    assert exact == {"median": 4.0, "low": 4.0, "high": 4.0}
    noisy = ratio_of_medians([120.0 + 10 * (k % 7) for k in range(40)], torch_costs)
    assert noisy["low"] < noisy["median"] < noisy["high"]
    unbounded = ratio_of_medians([1.0] * 10, [1.0] * 6 + [-1.0] * 4)  # some resamples' medians are <= 0
    assert unbounded["median"] == 1.0 and math.isnan(unbounded["low"]) and math.isnan(unbounded["high"])
    assert math.isnan(ratio_of_medians([1.0] * 3, [1.0] * 3)["low"])  # too few rounds for an interval


def test_a_bucket_cap_gives_the_bucket_count_it_is_made_for() -> None:
    assert Layout(128, 16).bucket_cap_mb() * 2**20 == pytest.approx(128 * 288 / 16)


@pytest.mark.slow
@pytest.mark.processes
def test_host_cost_benchmark_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "host_cost.json"
    argv = [sys.executable, os.path.join("benchmarks", "bench_host_cost.py"), "--quick", "--json", str(out)]
    completed = run_job(argv, timeout=180)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    rows = [line.split() for line in completed.stdout.splitlines() if " x Linear(8, 8)" in line]
    layers_tensors_buckets = [(row[0], row[4], row[5]) for row in rows]
    assert layers_tensors_buckets == [("16", "32", "1"), ("128", "256", "1"), ("128", "256", "16"),
                                      ("128", "256", "64")]  # fmt: skip
    assert all(float(value) > 0 for row in rows for value in row[6:9])  # plain, torch, ours us per step
    assert [line.split()[:3] for line in completed.stdout.splitlines() if line.startswith("per bucket")] == [
        ["per", "bucket", clock] for clock in ("thread", "process", "wall")
    ]
    results = json.loads(out.read_text())
    expected = {"16x1": 1, "128x1": 1, "128x16": 16, "128x64": 64}  # both wrappers make the buckets asked for
    assert results["buckets"] == {name: {"torch": count, "ours": count} for name, count in expected.items()}
    assert all(len(steps) == 6 * 2 for steps in results["times_us"]["thread"].values())
    assert results["clocks"]["thread"]["rounds"] == 6
