"""DDPXStrategy(comm_stats_every_n_steps=N) logs communication statistics to the Trainer's loggers."""

from __future__ import annotations

import csv
import os

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_ddpx import DDPXStrategy
from tests.dist_utils import run_distributed
from tests.strategy_helpers import fit, quiet

GRADIENT_BYTES = 4 * (8 * 16 + 16 + 16 * 4 + 4)  # TinyRegressor, fp32


def fit_with_csv_logger(rank: int, world_size: int, log_dir: str, every_n: int, accumulate: int) -> None:
    quiet()
    strategy = DDPXStrategy(comm_hook="fp16", comm_stats_every_n_steps=every_n)
    logger = CSVLogger(log_dir, name="stats", version=0)
    fit(strategy, max_steps=6, logger=logger, log_every_n_steps=1, accumulate_grad_batches=accumulate)


def read_stats_rows(log_dir: str) -> list[dict[str, str]]:
    with open(os.path.join(log_dir, "stats", "version_0", "metrics.csv")) as f:
        return [row for row in csv.DictReader(f) if row.get("ddpx/bytes_to_hook")]


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
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


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_bad_interval_is_refused_in_the_constructor(bad: object) -> None:
    with pytest.raises(ValueError, match="comm_stats_every_n_steps must be a positive number of steps"):
        DDPXStrategy(comm_stats_every_n_steps=bad)  # type: ignore[arg-type]


def test_statistics_are_off_by_default() -> None:
    assert DDPXStrategy().comm_stats_every_n_steps is None
