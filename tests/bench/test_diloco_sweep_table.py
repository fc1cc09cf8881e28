"""The DiLoCo sweep's table: paired seeds against torch's DDP, the benchmark's final loss and the dense window."""

from __future__ import annotations

import pytest

from benchmarks.sweep_diloco import final_losses, label, paired, table

DILOCO = {"period": 70, "outer_lr": 0.7, "outer_momentum": 0.3, "precision": "bf16"}


def _row(setting, seed, losses, every=5, steps=40):
    curve = [(every * (i + 1), loss, 0.9) for i, loss in enumerate(losses)]
    assert curve[-1][0] == steps
    return {
        "task": "digits",
        "setting": setting,
        "evaluate": "global",
        "seed": seed,
        "steps": steps,
        "val_every": every,
        "final_val_loss": sum(c[1] for c in curve[-2:]) / 2,
        "bytes_vs_ddp": None if setting == "torch-ddp" else 160.0,
        "curve": curve,
    }


def test_final_losses_benchmark_points_and_window():
    row = _row("torch-ddp", 0, [9, 9, 9, 1.0, 2.0, 3.0, 4.0, 5.0])  # steps 5..40
    bench, window = final_losses(row)
    assert bench == pytest.approx((1.0 + 5.0) / 2)  # steps 20 and 40
    assert window == pytest.approx(3.0)  # steps 20..40


def test_paired_ratio_and_per_seed_differences():
    out = paired([1.1, 2.2, 3.3], [1.0, 2.0, 3.0])
    assert out["ratio"] == pytest.approx(0.1)
    assert out["ratio_se"] == pytest.approx(0.0, abs=1e-12)
    assert out["diff"] == pytest.approx(0.1)
    out = paired([1.0, 3.0], [2.0, 2.0])
    assert out["ratio"] == pytest.approx(0.0)
    assert out["diff_se"] == pytest.approx(0.5)


def test_table_pairs_only_seeds_both_ran_and_merges_spellings():
    rows = [
        _row("torch-ddp", 0, [1.0] * 8),
        _row("torch-ddp", 1, [2.0] * 8),
        _row(DILOCO, 0, [1.5] * 8),
        _row({**DILOCO, "nesterov": True}, 1, [2.0] * 8),  # the same setting, spelled out
        _row(DILOCO, 2, [9.0] * 8),  # no torch's DDP run at seed 2: left out
    ]
    (line,) = [line for line in table(rows).splitlines() if line.startswith("| digits")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == label(DILOCO) == "H=70, lr=0.7, mom=0.3"
    assert cells[5] == "0,1"
    assert cells[6] == "1.7500 (1.5000)"
    assert cells[7].startswith("+16.7 %")
    assert cells[8].startswith("+25.0 % ± 25.0")
    assert cells[-2:] == ["160", ""]  # x fewer sent; received: not recorded by these rows


def test_a_sparse_setting_is_labelled_by_its_options_and_reports_received_bytes():
    sparse = {"period": 20, "outer_lr": 0.7, "outer_momentum": 0.3, "sparse": {"density": 0.01, "bits": 4}}
    assert label(sparse) == "H=20, lr=0.7, mom=0.3, sparse 1 % x 4 bits/4096, decay 0.999"
    rows = [_row("torch-ddp", 0, [1.0] * 8), {**_row(sparse, 0, [1.0] * 8), "received_vs_ddp": 80.0}]
    (line,) = [line for line in table(rows).splitlines() if line.startswith("| digits")]
    assert [c.strip() for c in line.strip("|").split("|")][-2:] == ["160", "80"]
