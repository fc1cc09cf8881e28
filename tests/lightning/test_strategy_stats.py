"""DDPXStrategy(comm_stats_every_n_steps=N) logs communication statistics to the Trainer's loggers."""

from __future__ import annotations

import csv
import os

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_ddpx import DDPXStrategy
from tests.dist_utils import run_distributed
from tests.strategy_helpers import fit, quiet

GRADIENT_BYTES = 4 * (8 * 16 + 16 + 16 * 4 + 4)  # TinyRegressor, fp32


def fit_with_csv_logger(rank: int, world_size: int, log_dir: str, every_n: int, accumulate: int) -> None:
    quiet()
    strategy = DDPXStrategy(comm_hook="fp16", comm_stats_every_n_steps=every_n)
    logger = CSVLogger(log_dir, name="stats", version=0)
    fit(strategy, max_steps=6, logger=logger, log_every_n_steps=1, accumulate_grad_batches=accumulate)


def fit_with_tensorboard(rank: int, world_size: int, log_dir: str) -> None:
    quiet()
    strategy = DDPXStrategy(
        comm_hook="powersgd", powersgd={"start_powerSGD_iter": 2}, comm_stats_every_n_steps=3
    )
    fit(strategy, max_steps=6, logger=TensorBoardLogger(log_dir, name="tb", version=0), log_every_n_steps=1)


def read_stats_rows(log_dir: str) -> list[dict[str, str]]:
    with open(os.path.join(log_dir, "stats", "version_0", "metrics.csv")) as f:
        return [row for row in csv.DictReader(f) if row.get("ddpx/bytes_to_hook")]


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.processes
def test_statistics_reach_the_csv_logger(tmp_path: os.PathLike, accumulate: int) -> None:
    log_dir = str(tmp_path)
    run_distributed(fit_with_csv_logger, 2, log_dir, 2, accumulate, init_process_group=False, timeout=180)
    rows = read_stats_rows(log_dir)
    # 6 optimizer steps = 6 synchronised backwards (accumulation only adds local ones): every 2nd is logged.
    assert len(rows) == 3, rows
    for row in rows:
        assert float(row["ddpx/bytes_to_hook"]) == GRADIENT_BYTES
        assert float(row["ddpx/bytes_sent"]) == GRADIENT_BYTES / 2  # fp16 halves what is sent
        assert float(row["ddpx/compression_ratio"]) == 2.0
        assert float(row["ddpx/hook_ms"]) > 0 and float(row["ddpx/exposed_comm_ms"]) >= 0
        assert float(row["ddpx/buckets"]) >= 1
    assert [int(row["step"]) for row in rows] == [1, 3, 5]  # the global step when the backward ran


@pytest.mark.slow
@pytest.mark.processes
def test_statistics_reach_tensorboard(tmp_path: os.PathLike) -> None:
    pytest.importorskip("tensorboardX")
    from tensorboardX.event_file_writer import event_pb2  # the event protocol buffer, to read the file back

    log_dir = str(tmp_path)
    run_distributed(fit_with_tensorboard, 2, log_dir, init_process_group=False, timeout=180)
    event_dir = os.path.join(log_dir, "tb", "version_0")
    scalars: dict[str, list[tuple[int, float]]] = {}
    for name in sorted(os.listdir(event_dir)):
        if name.startswith("events.out.tfevents"):
            for record in _tf_records(os.path.join(event_dir, name)):
                event = event_pb2.Event.FromString(record)
                for value in event.summary.value:
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    assert [step for step, _ in scalars["ddpx/bytes_to_hook"]] == [2, 5]  # synchronised steps 3 and 6
    assert all(v == GRADIENT_BYTES for _, v in scalars["ddpx/bytes_to_hook"])
    # Step 6 is compressed (PowerSGD from iteration 2): far fewer bytes sent than handed to the hook.
    assert scalars["ddpx/compression_ratio"][-1][1] > 1.5
    assert "ddpx/exposed_comm_ms" in scalars and "ddpx/hook_ms" in scalars


def _tf_records(path: str) -> list[bytes]:
    """The payloads of a TFRecord file (length, crc, payload, crc), as TensorBoard event files are stored."""
    import struct

    records = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            records.append(f.read(length))
            f.read(4)
    return records


@pytest.mark.parametrize(
    ("bad", "error"),
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("10", TypeError)],
)
def test_bad_interval_is_refused_in_the_constructor(bad: object, error: type) -> None:
    with pytest.raises(error, match="comm_stats_every_n_steps must be (an integer )?>= 1 or None, got"):
        DDPXStrategy(comm_stats_every_n_steps=bad)  # type: ignore[arg-type]


def test_statistics_are_off_by_default() -> None:
    assert DDPXStrategy().comm_stats_every_n_steps is None
