"""torch.compile with lightning_ddpx.DistributedDataParallel: split at bucket boundaries vs compiled whole.

    python benchmarks/bench_compile.py                              # transformer, inductor, 60 steps
    python benchmarks/bench_compile.py --backend aot_eager --steps 30 --json out.json

Three copies of the same model train in the same two processes, interleaved in short blocks (see
``benchmarks.common.interleaved_timing``): eager, ``compile_model(ddp, split=True)`` and
``compile_model(ddp, split=False)``. For each step rank 0 records the step time and the exposed
communication (``reducer.last_exposed_comm_s``: how long the end of backward waited for buckets still in
flight). Compiled whole, AOTAutograd makes every gradient ready at the end of backward, so all communication
is exposed; split, bucket 0 is reduced while the earlier pieces' backward runs. The headline numbers are the
ratios split/whole of step time and the medians of exposed communication. See docs/compile.md.
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
    build_model,
    environment_info,
    format_table,
    interleaved_timing,
    launch,
    make_batch,
    make_train_step,
    max_param_diff,
    model_names,
    percentile,
    summarize_pair,
    write_json,
)

CONTENDERS = ("eager", "whole", "split")  # "whole" is the baseline of the headline ratio split/whole


@dataclass(frozen=True)
class RunConfig:
    """Everything one 2-process job needs; identical on both ranks."""

    model: str
    backend: str
    steps: int
    warmup: int
    block: int
    bucket_cap_mb: float
    lr: float
    seed: int
    verbose: bool


def run_rank(rank: int, world_size: int, config: RunConfig) -> dict[str, Any]:
    """Body of one rank: three wrapped copies (eager, compiled whole, compiled split), timed interleaved."""
    from lightning_ddpx import DistributedDataParallel, compile_model, compiled_graphs

    torch.set_flush_denormal(True)  # constant arithmetic cost as weights drift (see bench_engine.py)
    modules = {name: build_model(config.model, config.seed) for name in CONTENDERS}
    wrapped = {
        name: DistributedDataParallel(modules[name], bucket_cap_mb=config.bucket_cap_mb)
        for name in CONTENDERS
    }
    compile_model(wrapped["whole"], backend=config.backend, split=False)
    compile_model(wrapped["split"], backend=config.backend, split=True)
    batch = make_batch(config.model, rank, config.seed)
    steps = {
        name: make_train_step(wrapped[name], torch.optim.SGD(wrapped[name].parameters(), lr=config.lr), batch)
        for name in CONTENDERS
    }
    exposed: dict[str, list[float]] = {name: [] for name in CONTENDERS}

    def recorder(name: str) -> Any:
        return lambda: exposed[name].append(float(wrapped[name].reducer.last_exposed_comm_s))

    def report_round(r: int, rounds: int, times: dict[str, list[float]]) -> None:
        if rank == 0 and config.verbose:
            parts = [f"{name} " + " ".join(f"{1e3 * t:7.1f}" for t in times[name]) for name in CONTENDERS]
            print(f"  round {r + 1:3d}/{rounds}  " + "  | ".join(parts) + "  ms", flush=True)

    gc.collect()
    times = interleaved_timing(
        steps,
        timed_steps=config.steps,
        warmup_steps=config.warmup,
        block=config.block,
        on_block=report_round,
        after_step={name: recorder(name) for name in CONTENDERS},
    )
    return {
        "rank": rank,
        "times_s": times,
        "exposed_comm_s": exposed,
        "buckets": len(wrapped["split"].bucket_plan()),
        "pieces": {name: [g.pieces for g in compiled_graphs(wrapped[name])] for name in ("whole", "split")},
        # Compiled and eager do the same maths up to float reordering: a large difference means a bug.
        "param_max_abs_diff": {
            name: max_param_diff(modules["eager"], modules[name]) for name in ("whole", "split")
        },
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """One 2-process job per model; prints live rounds and the summary, returns the JSON-able results."""
    print(
        f"torch.compile + lightning_ddpx: 2 processes, gloo on 127.0.0.1, 1 thread each; backend "
        f"{args.backend}; {args.steps} timed steps each after {args.warmup} warm-up (compilation), "
        f"blocks of {args.block}",
        flush=True,
    )
    results: dict[str, Any] = {"config": vars(args).copy(), "environment": environment_info(), "models": {}}
    rows = []
    for name in args.models:
        print(f"\n[{name}] {MODELS[name].description}", flush=True)
        config = RunConfig(
            model=name,
            backend=args.backend,
            steps=args.steps,
            warmup=args.warmup,
            block=args.block,
            bucket_cap_mb=args.bucket_cap_mb,
            lr=args.lr,
            seed=args.seed,
            verbose=not args.quiet,
        )
        rank0 = launch(run_rank, (config,), world_size=2, timeout_s=args.timeout)[0]
        summary = summarize_pair(rank0["times_s"]["whole"], rank0["times_s"]["split"])
        medians = {c: 1e3 * percentile(rank0["times_s"][c], 50) for c in CONTENDERS}
        exposed = {c: 1e3 * percentile(rank0["exposed_comm_s"][c], 50) for c in CONTENDERS}
        print(
            f"[{name}] {rank0['buckets']} buckets; pieces per graph: {rank0['pieces']}; "
            f"max |param - eager|: {rank0['param_max_abs_diff']}",
            flush=True,
        )
        results["models"][name] = {
            "buckets": rank0["buckets"],
            "pieces": rank0["pieces"],
            "param_max_abs_diff": rank0["param_max_abs_diff"],
            "step_ms": {c: [1e3 * t for t in rank0["times_s"][c]] for c in CONTENDERS},
            "exposed_comm_ms": {c: [1e3 * t for t in rank0["exposed_comm_s"][c]] for c in CONTENDERS},
            "split_vs_whole": asdict(summary),
        }
        rows.append(
            [
                name,
                f"{medians['eager']:.1f}",
                f"{medians['whole']:.1f}",
                f"{medians['split']:.1f}",
                f"{summary.ratio:.3f} [{summary.ratio_p25:.3f}-{summary.ratio_p75:.3f}]",
                f"{exposed['eager']:.1f}",
                f"{exposed['whole']:.1f}",
                f"{exposed['split']:.1f}",
                "PASS" if summary.ratio <= 1.0 and exposed["split"] < exposed["whole"] else "MISS",
            ]
        )
    print(
        f"\nSummary (median ms over {args.steps} interleaved steps; ratio = median of same-round split/whole):"
    )
    header = [
        "model",
        "eager",
        "whole",
        "split",
        "split/whole",
        "exposed eager",
        "exposed whole",
        "exposed split",
    ]
    print(format_table(header + ["target"], rows), flush=True)
    write_json(args.json, results)
    if args.json:
        print(f"results written to {args.json}")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="transformer", help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--backend", default="inductor", help="inner compiler: inductor, aot_eager, ...")
    parser.add_argument(
        "--steps", type=int, default=60, help="timed steps per contender (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed steps first: >= 3 covers eager steps, bucket rebuild and compilation (default: %(default)s)",
    )
    parser.add_argument("--block", type=int, default=5, help="steps of one contender before switching")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=4.0,
        help="bucket cap; the transformer has ~13 MB of gradients, so 4 gives several buckets (default: %(default)s)",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per model's job")
    parser.add_argument("--json", metavar="PATH", help="write every step time and the summary here")
    parser.add_argument("--quiet", action="store_true", help="do not print each round's step times")
    args = parser.parse_args(argv)
    args.models = model_names(parser, args.models)
    if args.steps < 1 or args.block < 1 or args.warmup < 3:
        parser.error("--steps and --block must be >= 1 and --warmup >= 3")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point: parse ``argv`` (default: the command line) and run the benchmark; returns the results."""
    return run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
