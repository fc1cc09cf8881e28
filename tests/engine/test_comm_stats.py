"""Communication statistics: exact byte counts on a model with known sizes, for each built-in hook.

The model is two 64x64 linear layers plus an 8x64 head (all with biases), so every figure below can be
worked out by hand: 4 bytes per fp32 element, 2 per fp16 element.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import lightning_ddpx
from lightning_ddpx.engine.reducer.comm_stats import CommStatsWindow, StepCommStats
from lightning_ddpx.hooks import build_comm_hook
from tests.dist_utils import run_distributed

SHAPES = [(64, 64), (64,), (64, 64), (64,), (8, 64), (8,)]  # parameters in declaration order
NUMEL = sum(math.prod(s) for s in SHAPES)  # 8200
STEPS = 4
START_POWERSGD_ITER = 2


def known_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def expected_powersgd_bytes(rank: int) -> int:
    """One bucket: P (rows x r) and Q (cols x r) per compressible matrix, the rest sent as is (fp32)."""
    elements = 0
    for shape in SHAPES:
        if len(shape) == 2 and (shape[0] + shape[1]) * rank * 2 < shape[0] * shape[1]:
            elements += (shape[0] + shape[1]) * rank
        else:
            elements += math.prod(shape)
    return 4 * elements


def expected_batched_bytes(rank: int) -> int:
    side = math.isqrt(NUMEL - 1) + 1  # the bucket as a zero-padded square
    return 4 * 2 * side * rank


def train_and_report(rank: int, world_size: int, hook_name: str | None, bucket_cap_mb: float) -> dict:
    model = lightning_ddpx.DistributedDataParallel(
        known_model(), bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=bucket_cap_mb
    )
    if hook_name is not None:
        options = {"start_powerSGD_iter": START_POWERSGD_ITER} if "powersgd" in hook_name else None
        state, hook = build_comm_hook(hook_name, powersgd=options)
        model.register_comm_hook(state, hook)
    steps: list[StepCommStats] = []
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        model(torch.randn(16, 64, generator=generator)).square().mean().backward()
        stats = model.comm_stats()
        assert stats is not None
        steps.append(stats)
    window = model.take_comm_stats()
    model.close()
    return {
        "steps": steps,
        "window": window,
        "window_after_take": model.take_comm_stats(),
        "history": [(before, len(plan)) for before, plan in model.bucket_plan_history()],
    }


@pytest.mark.parametrize(
    "hook_name, bucket_cap_mb, to_bytes_sent",
    [
        (None, 0.01, lambda: 4 * NUMEL),  # the default path, several buckets
        ("allreduce", 0.01, lambda: 4 * NUMEL),
        ("fp16", 0.01, lambda: 2 * NUMEL),
        ("bf16", 0.01, lambda: 2 * NUMEL),
        ("noop", 0.01, lambda: 0),
        ("powersgd", 1.0, lambda: expected_powersgd_bytes(1)),  # one bucket: the expected figure is simple
        ("batched_powersgd", 1.0, lambda: expected_batched_bytes(1)),
    ],
)
@pytest.mark.processes
def test_bytes_per_step_match_the_hook(
    hook_name: str | None, bucket_cap_mb: float, to_bytes_sent: Any
) -> None:
    result = run_distributed(train_and_report, 2, hook_name, bucket_cap_mb, timeout=90)[0]
    steps: list[StepCommStats] = result["steps"]
    assert [s.iteration for s in steps] == list(range(1, STEPS + 1))
    for step in steps:
        assert step.bytes_to_hook == 4 * NUMEL, step
        assert step.hook_s > 0 and step.exposed_comm_s >= 0, step
    last = steps[-1]  # PowerSGD compresses from iteration START_POWERSGD_ITER on
    assert last.bytes_sent == to_bytes_sent(), last
    if hook_name and "powersgd" in hook_name:
        assert steps[0].bytes_sent == 4 * NUMEL  # before start_powerSGD_iter: plain averaging
        assert last.compression_ratio is not None and last.compression_ratio > 10
    if bucket_cap_mb < 1:
        assert last.buckets > 1, "the small cap was meant to give several buckets"

    window = result["window"]
    assert window.steps == STEPS and window.last_iteration == STEPS
    assert window.bytes_to_hook == 4 * NUMEL
    expected_mean_sent = sum(s.bytes_sent for s in steps) / STEPS
    assert window.bytes_sent == pytest.approx(expected_mean_sent)
    metrics = window.as_metrics()
    assert metrics["ddpx/bytes_to_hook"] == 4 * NUMEL
    assert metrics["ddpx/exposed_comm_ms"] == pytest.approx(
        1e3 * sum(s.exposed_comm_s for s in steps) / STEPS
    )
    assert result["window_after_take"] is None
    # The construction-time plan, then the rebuild after the first iteration.
    assert [before for before, _ in result["history"]] == [0, 1]


def test_a_hook_that_does_not_report_leaves_bytes_sent_unknown() -> None:
    """torch's own hooks do not report what they send: the statistics say "unknown", never a made-up 0."""
    window = CommStatsWindow()
    window.add(StepCommStats(1, 2, 1000, 500, 0.001, 0.002))
    window.add(StepCommStats(2, 2, 1000, None, 0.001, 0.004))
    summary = window.take()
    assert summary is not None and summary.bytes_sent is None and summary.compression_ratio is None
    metrics = summary.as_metrics(prefix="x/")
    assert "x/bytes_sent" not in metrics and "x/compression_ratio" not in metrics
    assert metrics["x/exposed_comm_ms"] == pytest.approx(3.0)
    assert metrics["x/exposed_comm_max_ms"] == pytest.approx(4.0)
    assert window.take() is None


def torch_hook_report(rank: int, world_size: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = lightning_ddpx.DistributedDataParallel(known_model())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model(torch.randn(4, 64)).sum().backward()
    stats = model.comm_stats()
    model.close()
    return {"stats": stats}


@pytest.mark.processes
def test_torch_hook_on_our_module_reports_unknown_bytes_sent() -> None:
    stats = run_distributed(torch_hook_report, 2, timeout=60)[0]["stats"]
    assert stats.bytes_to_hook == 4 * NUMEL and stats.bytes_sent is None


def profiled_step(rank: int, world_size: int) -> list[str]:
    model = lightning_ddpx.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)), bucket_cap_mb=1e-4
    )
    model(torch.randn(4, 8)).sum().backward()  # the first iteration: rebuild afterwards
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        model(torch.randn(4, 8)).sum().backward()
    model.close()
    return sorted(
        {event.key for event in profiler.key_averages() if event.key.startswith("lightning_ddpx::")}
    )


@pytest.mark.processes
def test_hot_paths_carry_profiler_labels() -> None:
    """The labels show up under torch.profiler (and cost nothing without it: lightning_ddpx.engine.profiling)."""
    labels = run_distributed(profiled_step, 2, timeout=60)[0]
    assert labels == [
        "lightning_ddpx::broadcast_buffers",
        "lightning_ddpx::comm_hook",
        "lightning_ddpx::finalize",
        "lightning_ddpx::launch_bucket",
    ], labels
