"""What uneven-input handling costs, on 2 gloo processes.

    python benchmarks/bench_join.py                      # tiny and many, ~1 minute
    python benchmarks/bench_join.py --models mlp --steps 30 --json join.json

Even inputs, three contenders timed interleaved in the same two processes (see ``lightning_ddpx.bench.timing``):

- ``plain``: our module, a normal training step;
- ``join()``: the same step inside ``model.join()`` -- what every step pays for being *able* to shadow
  (torch's "not joined" allreduce, and our announcement allreduce of what the forward will communicate);
- ``lockstep``: a normal step plus one ``next()`` of the strategies' lockstep loader (``uneven_inputs="join"``),
  i.e. one small allreduce per batch.

Then the uneven case: rank 1 has no input and shadows inside ``join()`` while rank 0 trains; rank 0's step
time against its plain step shows what a shadowing peer costs the ranks that still train.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

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
    summarize_pair,
    write_json,
)


@dataclass(frozen=True)
class RunConfig:
    model: str
    steps: int
    warmup: int
    block: int
    seed: int


def run_rank(rank: int, world_size: int, config: RunConfig) -> dict[str, Any]:
    from lightning_ddpx import DistributedDataParallel
    from lightning_ddpx.lightning.features.uneven import LockstepLoader, StepQueue

    torch.set_flush_denormal(True)
    batch = make_batch(config.model, rank, config.seed)
    models = {
        name: DistributedDataParallel(build_model(config.model, config.seed)) for name in ("plain", "join()")
    }
    models["lockstep"] = DistributedDataParallel(build_model(config.model, config.seed))
    steps = {
        name: make_train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), batch)
        for name, ddp in models.items()
    }
    total = config.steps + config.warmup + 2
    loader = iter(LockstepLoader(range(total), "join", dist.group.WORLD, torch.device("cpu"), StepQueue()))
    lockstep_train = steps["lockstep"]

    def lockstep_step() -> None:
        next(loader)
        lockstep_train()

    steps["lockstep"] = lockstep_step
    context = models["join()"].join()
    context.__enter__()  # even inputs: inside the context for every join() step, exited at the end
    gc.collect()
    times = interleaved_timing(steps, config.steps, config.warmup, config.block)
    context.__exit__(None, None, None)

    # Uneven: rank 1 has no input at all and shadows inside join(); rank 0 trains config.steps steps.
    shadowed = DistributedDataParallel(build_model(config.model, config.seed))
    step = make_train_step(shadowed, torch.optim.SGD(shadowed.parameters(), lr=1e-3), batch)
    uneven: list[float] = []
    with shadowed.join():
        if rank == 0:
            for i in range(config.warmup + config.steps):
                started = time.perf_counter()
                step()
                if i >= config.warmup:
                    uneven.append(time.perf_counter() - started)
    for ddp in (*models.values(), shadowed):
        ddp.close()
    return {"times_s": times, "uneven_s": uneven}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="tiny,many")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    models = model_names(parser, args.models)
    rows, results = [], {"environment": environment_info(), "config": vars(args), "models": {}}
    for model in models:
        print(f"[{model}] {MODELS[model].description}: {args.steps} interleaved steps each", flush=True)
        rank0 = launch(
            run_rank, (RunConfig(model, args.steps, args.warmup, args.block, args.seed),), world_size=2
        )[0]
        plain = rank0["times_s"]["plain"]
        joined = summarize_pair(plain, rank0["times_s"]["join()"])
        lockstep = summarize_pair(plain, rank0["times_s"]["lockstep"])
        uneven_ms = 1e3 * percentile(rank0["uneven_s"], 50)
        results["models"][model] = {
            "join": joined.__dict__,
            "lockstep": lockstep.__dict__,
            "uneven_ms": uneven_ms,
        }
        rows.append(
            [
                model,
                f"{joined.baseline_ms:.2f}",
                f"{joined.candidate_ms:.2f} ({joined.ratio:.3f})",
                f"{lockstep.candidate_ms:.2f} ({lockstep.ratio:.3f})",
                f"{uneven_ms:.2f} ({uneven_ms / joined.baseline_ms:.3f})",
            ]
        )
    header = ["model", "plain ms", "join() ms (ratio)", "lockstep ms (ratio)", "peer shadowing ms (ratio)"]
    print("\n" + format_table(header, rows), flush=True)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
