"""What replica verification costs: ``verify_replicas`` every N steps, as a share of the step time.

    python benchmarks/bench_replica_check.py                  # mlp, transformer, many; N = 1, 10, 100
    python benchmarks/bench_replica_check.py --models mlp --json replica.json

Two processes, one ``lightning_ddpx.DistributedDataParallel`` per model, the benchmark's training step.
Verifying every 100 steps adds 1 % of a step at most when the verification itself takes less than one
step; a 1 % difference is far below the step-to-step noise of a 2-process run, so the cost is measured
directly, side by side in the same processes: training steps and verifications interleaved in rounds
(``lightning_ddpx.bench.timing``), medians of each, and the cost at N printed as
``verification / (N * step)``. Also printed: the verification with the optimizer state (SGD momentum)
and the per-forward check for ``requires_grad`` changes (always on, no communication).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    MODELS,
    build_model,
    environment_info,
    format_table,
    interleaved_timing,
    launch,
    make_batch,
    make_train_step,
    model_names,
    percentile,
    write_json,
)

TARGET_AT_100 = 0.01  # verification every 100 steps: under 1 % of the step time
EVERY = (1, 10, 100)


@dataclass(frozen=True)
class RunConfig:
    model: str
    rounds: int
    warmup: int
    seed: int


def run_rank(rank: int, world_size: int, config: RunConfig) -> dict[str, Any]:
    from lightning_ddpx import DistributedDataParallel

    torch.set_flush_denormal(True)
    ddp = DistributedDataParallel(build_model(config.model, config.seed))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    train_step = make_train_step(ddp, optimizer, make_batch(config.model, rank, config.seed))
    contenders = {
        "step": train_step,
        "verify": lambda: ddp.verify_replicas(step=0),
        "verify+optimizer": lambda: ddp.verify_replicas(step=0, optimizer=optimizer),
        "requires_grad check": lambda: [ddp._trainable.changed() for _ in range(100)],  # x100: resolution
    }
    gc.collect()
    times = interleaved_timing(contenders, config.rounds, config.warmup, block=1)
    bytes_checked = ddp.verify_replicas(step=0).bytes_per_rank
    ddp.close()
    return {"times_s": times, "bytes": bytes_checked, "tensors": len(list(ddp.parameters()))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="mlp,transformer,many")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    models = model_names(parser, args.models)
    rows, results = [], {"environment": environment_info(), "config": vars(args), "models": {}}
    for model in models:
        print(f"[{model}] {MODELS[model].description}: {args.rounds} interleaved rounds", flush=True)
        rank0 = launch(run_rank, (RunConfig(model, args.rounds, args.warmup, args.seed),), world_size=2)[0]
        median = {name: percentile(values, 50) for name, values in rank0["times_s"].items()}
        step, verify = median["step"], median["verify"]
        costs = {n: verify / (n * step) for n in EVERY}
        check_share = median["requires_grad check"] / 100 / step
        result = "PASS" if costs[100] < TARGET_AT_100 else "FAIL"
        results["models"][model] = {"median_s": median, "cost_share": costs, "check_share": check_share,
                                    "result": result, **rank0}  # fmt: skip
        rows.append(
            [
                model,
                f"{rank0['tensors']} / {rank0['bytes'] / 2**20:.1f} MiB",
                f"{1e3 * step:.2f}",
                f"{1e3 * verify:.2f}",
                f"{1e3 * median['verify+optimizer']:.2f}",
                *(f"{100 * costs[n]:.2f} %" for n in EVERY),
                f"{100 * check_share:.3f} %",
                result,
            ]
        )
    header = ["model", "tensors / size", "step ms", "verify ms", "+optimizer ms",
              *(f"cost N={n}" for n in EVERY), "requires_grad check", "N=100 < 1 %"]  # fmt: skip
    print("\n" + format_table(header, rows), flush=True)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
