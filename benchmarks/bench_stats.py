"""What collecting communication statistics costs: our module with statistics on vs off, same run.

    python benchmarks/bench_stats.py                     # mlp, transformer and many; target ratio <= 1.01
    python benchmarks/bench_stats.py --models many --steps 120 --json stats.json

Two copies of the same model in the same two processes, both ``lightning_ddpx.DistributedDataParallel``
with the default reduction; one has ``reducer.stats = NoCommStats()`` (records nothing). Timed interleaved (see
``lightning_ddpx.bench.timing``); the ratio on/off of same-round steps is the cost. ``many`` (300 tensors,
many buckets) is where per-bucket bookkeeping weighs most.

A 2-process step varies by several percent from step to step, far more than the few microseconds the
statistics cost, so ``--micro`` also measures the cost directly: one process, a tiny model cut into 100
one-parameter buckets, 2000 steps on and off interleaved, reported in microseconds per bucket.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    MODELS,
    TARGET_RATIOS,
    build_model,
    environment_info,
    format_table,
    interleaved_timing,
    launch,
    make_batch,
    make_train_step,
    model_names,
    summarize_pair,
    verdict,
    write_json,
)
from lightning_ddpx.engine.reducer.comm_stats import NoCommStats  # noqa: E402

TARGET = 1.01  # statistics on: step time within 1 % of statistics off


@dataclass(frozen=True)
class RunConfig:
    model: str
    steps: int
    warmup: int
    block: int
    seed: int


def run_rank(rank: int, world_size: int, config: RunConfig) -> dict[str, Any]:
    from lightning_ddpx import DistributedDataParallel

    torch.set_flush_denormal(True)
    wrapped = {}
    for name in ("stats-off", "stats-on"):
        wrapped[name] = DistributedDataParallel(build_model(config.model, config.seed))
    wrapped["stats-off"].reducer.stats = NoCommStats()  # the alternative injected: records nothing
    batch = make_batch(config.model, rank, config.seed)
    steps = {
        name: make_train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), batch)
        for name, ddp in wrapped.items()
    }
    gc.collect()
    times = interleaved_timing(steps, config.steps, config.warmup, config.block)
    logged = wrapped["stats-on"].comm_stats()
    for ddp in wrapped.values():
        ddp.close()
    return {"times_s": times, "stats_on_last_step": asdict(logged) if logged else None}


def micro_overhead(steps: int = 2000, block: int = 100) -> dict[str, float]:
    """Microseconds per step and per bucket that collecting statistics adds, on a 1-process gloo group."""
    import torch.distributed as dist
    from torch import nn

    from benchmarks.common import free_port, percentile
    from lightning_ddpx import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        wrapped = {}
        for name in ("off", "on"):
            torch.manual_seed(0)
            net = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(100)])
            wrapped[name] = DistributedDataParallel(net, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
        wrapped["off"].reducer.stats = NoCommStats()
        x = torch.randn(2, 4)

        def step(model: torch.nn.Module) -> None:
            model(x).sum().backward()

        steps_of = {name: (lambda m=m: step(m)) for name, m in wrapped.items()}
        times = interleaved_timing(steps_of, steps, warmup_steps=20, block=block)
        buckets = len(wrapped["on"].bucket_plan())
        for model in wrapped.values():
            model.close()
    finally:
        dist.destroy_process_group()
    off_us, on_us = (1e6 * percentile(times[n], 50) for n in ("off", "on"))
    return {"buckets": buckets, "off_us": off_us, "on_us": on_us, "per_bucket_us": (on_us - off_us) / buckets}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="mlp,transformer,many")
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--micro", action="store_true", help="also measure microseconds per bucket directly")
    args = parser.parse_args(argv)
    models = model_names(parser, args.models)
    rows, results = [], {"environment": environment_info(), "config": vars(args), "models": {}}
    for model in models:
        print(f"[{model}] {MODELS[model].description}: {args.steps} interleaved steps each", flush=True)
        config = RunConfig(model, args.steps, args.warmup, args.block, args.seed)
        rank0 = launch(run_rank, (config,), world_size=2)[0]
        summary = summarize_pair(rank0["times_s"]["stats-off"], rank0["times_s"]["stats-on"])
        result = verdict(summary.ratio, TARGET if model in TARGET_RATIOS else None)
        results["models"][model] = {"summary": asdict(summary), "result": result, **rank0}
        rows.append(
            [
                model,
                f"{summary.baseline_ms:.1f}",
                f"{summary.candidate_ms:.1f}",
                f"{summary.ratio:.3f}",
                f"{summary.ratio_p25:.3f}-{summary.ratio_p75:.3f}",
                f"<= {TARGET}",
                result,
            ]
        )
    header = ["model", "stats off ms", "stats on ms", "ratio on/off", "ratio p25-p75", "target", "result"]
    print("\n" + format_table(header, rows), flush=True)
    if args.micro:
        micro = results["micro"] = micro_overhead()
        print(
            f"\nmicro: {micro['buckets']} buckets per step, median step {micro['off_us']:.0f} us off, "
            f"{micro['on_us']:.0f} us on: {micro['per_bucket_us']:.2f} us per bucket",
            flush=True,
        )
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
