"""The whole-state digests a fault-tolerant heal compares (lightning_ddpx/lightning/fault_tolerance/state.py):
each piece that decides later updates changes its digest; what is per process by design does not."""

from __future__ import annotations

import copy

import torch

from lightning_ddpx.lightning.fault_tolerance.state import digest, state_digests


def checkpoint() -> dict:
    return {
        "state_dict": {"net.weight": torch.ones(2, 2), "net.bn.running_mean": torch.zeros(2)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.01}]}],
        "lr_schedulers": [{"best": 0.5, "num_bad_epochs": 0}],
        "loops": {
            "fit_loop": {
                "epoch_progress": {"total": {"completed": 2}},
                "epoch_loop.val_loop.batch_progress": {"current": {"ready": 8}},
            },
            "validate_loop": {"batch_progress": {"current": {"ready": 3}}},
        },
        "epoch": 2,
        "global_step": 32,
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss'}": {
                "best_model_score": torch.tensor(0.3),
                "best_k_models": {"a.ckpt": torch.tensor(0.3)},
                "current_score": torch.tensor(0.4),
            },
            "EarlyStopping{'monitor': 'val_loss'}": {"wait_count": 1, "best_score": torch.tensor(0.3)},
        },
    }


def test_each_piece_that_decides_later_updates_changes_its_own_digest():
    base = state_digests(checkpoint(), ["net.weight"])
    edits = {
        "parameters": lambda c: c["state_dict"]["net.weight"].add_(1e-7),
        "optimizer state": lambda c: c["optimizer_states"][0]["state"][0]["step"].add_(1),
        "optimizer hyper-parameters": lambda c: c["optimizer_states"][0]["param_groups"][0].update(lr=0.005),
        "schedulers": lambda c: c["lr_schedulers"][0].update(num_bad_epochs=1),
        "loops": lambda c: c["loops"]["fit_loop"]["epoch_progress"]["total"].update(completed=3),
        "progress": lambda c: c.update(global_step=33),
        "EarlyStopping{'monitor': 'val_loss'}": lambda c: c["callbacks"][
            "EarlyStopping{'monitor': 'val_loss'}"
        ].update(wait_count=2),
        "ModelCheckpoint{'monitor': 'val_loss'}": lambda c: c["callbacks"][
            "ModelCheckpoint{'monitor': 'val_loss'}"
        ]["best_k_models"].update({"b.ckpt": torch.tensor(0.35)}),
    }
    assert set(edits) == set(base)
    for piece, edit in edits.items():
        changed = checkpoint()
        edit(changed)
        differing = {
            name for name, value in state_digests(changed, ["net.weight"]).items() if value != base[name]
        }
        assert differing == {piece}, (piece, differing)


def test_what_is_per_process_by_design_leaves_every_digest_alike():
    base = state_digests(checkpoint(), ["net.weight"])
    changed = checkpoint()
    changed["state_dict"]["net.bn.running_mean"].add_(1.0)  # a buffer: each rank's own between forwards
    changed["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]["current"]["ready"] = 0
    changed["loops"]["validate_loop"]["batch_progress"]["current"]["ready"] = 0
    changed["callbacks"]["ModelCheckpoint{'monitor': 'val_loss'}"]["current_score"] = None
    assert state_digests(changed, ["net.weight"]) == base


def test_the_digest_tells_dtype_shape_and_order_apart():
    assert digest(torch.zeros(2)) != digest(torch.zeros(2, dtype=torch.float64))
    assert digest(torch.zeros(4)) != digest(torch.zeros(2, 2))
    assert digest([1, 2]) != digest([2, 1])
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest(copy.deepcopy(checkpoint())) == digest(checkpoint())


def test_a_loggers_failure_in_a_training_process_is_reported_once_and_training_goes_on(caplog):
    """contain_logger_failures: every call Lightning makes on a logger (metrics, hyper-parameters, save,
    finalize...) that raises is reported once per logger and call, at WARNING, and returns; a logger that
    works is untouched in what it records."""
    from types import SimpleNamespace

    from lightning_ddpx.lightning.fault_tolerance.launch import contain_logger_failures

    class Broken:
        def __init__(self) -> None:
            self.calls = 0

        def log_metrics(self, metrics, step=None):
            self.calls += 1
            raise OSError("No space left on device")

        def save(self):
            raise ValueError("dict contains fields not in fieldnames: 'val_loss'")

    class Working:
        def __init__(self) -> None:
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, metrics))

    broken, working = Broken(), Working()
    trainer = SimpleNamespace(loggers=[broken, working])
    contain_logger_failures(trainer)
    contain_logger_failures(trainer)  # twice (a second fit's set-up): wrapped once
    with caplog.at_level("WARNING"):
        for step in range(3):
            broken.log_metrics({"loss": 1.0}, step)
            broken.save()
            working.log_metrics({"loss": 1.0}, step)
    assert broken.calls == 3 and working.rows == [(s, {"loss": 1.0}) for s in range(3)]
    reports = [r.getMessage() for r in caplog.records if "training goes on" in r.getMessage()]
    assert len(reports) == 2, reports  # one per failing call, not per step
    assert any("Broken.log_metrics failed (OSError: No space left on device)" in r for r in reports)
    assert any("Broken.save failed (ValueError" in r for r in reports)


def test_a_new_rank_0s_csv_writer_continues_a_file_whose_columns_grew_after_it_started(tmp_path):
    """The lost rank 0 added columns (val_loss) after the process that becomes rank 0 had started its
    writer; that writer's first save (with a column of its own, LearningRateMonitor's) keeps every row and
    column already in metrics.csv."""
    import csv

    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    from lightning_ddpx.lightning._compat import ContinuingCSVWriter

    first = _ExperimentWriter(str(tmp_path))
    first.log_metrics({"train_loss": 1.0}, step=0)
    first.save()
    later_rank_0 = ContinuingCSVWriter(str(tmp_path))  # started now, while the first still writes
    first.log_metrics({"train_loss": 0.9, "val_loss": 0.8}, step=1)
    first.save()  # the first rewrites the header with val_loss, then is lost
    later_rank_0.log_metrics({"train_loss": 0.7, "lr-Adam": 0.01}, step=2)
    later_rank_0.save()
    later_rank_0.log_metrics({"val_loss": 0.6}, step=3)
    later_rank_0.save()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [row["step"] for row in rows] == ["0", "1", "2", "3"]
    assert [row["val_loss"] for row in rows] == ["", "0.8", "", "0.6"]
    assert rows[2]["lr-Adam"] == "0.01" and rows[1]["train_loss"] == "0.9"
