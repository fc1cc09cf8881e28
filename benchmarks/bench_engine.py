"""Step time of lightning_ddpx.DistributedDataParallel against torch's, on a 2-process CPU gloo job.

    python benchmarks/bench_engine.py                      # all three models, default allreduce
    python benchmarks/bench_engine.py --noop               # no-communication hook on both: compute-only
    python benchmarks/bench_engine.py --gradient-as-bucket-view --models many --steps 200 --json out.json
    python benchmarks/bench_engine.py --models many many1000 mlp transformer   # 300 and 1,000 small tensors
    python benchmarks/bench_engine.py --world-size 3                             # three ranks
    python benchmarks/snapshot_package.py <rev> /tmp/before                      # the package at <rev> ...
    python benchmarks/bench_engine.py --before /tmp/before     # ... as a third contender: before/after a change
    DDPX_SHARED_MEMORY=0 python benchmarks/bench_engine.py --halves   # + ours with large buckets in halves
    python benchmarks/bench_engine.py --gloo     # + ours summing over gloo where it would use shared memory

Both modules train their own copy of the same model, in the same two processes, interleaved in short blocks
(see ``benchmarks.common.interleaved_timing`` for why): the number that matters is the ratio ours/torch of
step times measured close together, not the absolute milliseconds, which drift on a shared machine.
A step is zero_grad, forward, MSE loss, backward (gradient synchronisation), SGD step; rank 0 times it with
``time.perf_counter`` and both ranks run exactly the same schedule. See docs/benchmarks.md.
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
    max_param_diff,
    model_names,
    parameter_summary,
    ratio_interval,
    summarize_pair,
    write_json,
)

DEFAULT_MODELS = ("mlp", "transformer", "many")
# glibc's malloc never gives the heap's top back (trim) and takes blocks up to 32 MiB from the heap (mmap):
# memory freed by one step is reused by the next instead of being returned and faulted in again, which
# happens to one contender more than the other depending on where the heap's blocks fall.
STEADY_ALLOCATOR = "glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432"
CONTENDERS = ("torch", "ours")  # baseline first: ratios are ours / torch


@dataclass(frozen=True)
class RunConfig:
    """Everything one 2-process job needs; identical on both ranks, so both do identical work."""

    model: str
    steps: int
    warmup: int
    block: int
    noop: bool
    gradient_as_bucket_view: bool
    before: str | None  # a directory holding benchmarks/snapshot_package.py's lightning_ddpx_before
    halves: bool  # a contender "halves": ours with benchmarks.alt_transports.MeanAllReduceInHalves injected
    gloo: bool  # a contender "gloo": ours with the plain MeanAllReduce injected (no shared memory)
    lr: float
    seed: int
    verbose: bool


def run_rank(rank: int, world_size: int, config: RunConfig) -> dict[str, Any]:
    """Body of one rank: wrap two copies of the model, one in each DDP, and time them interleaved."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from lightning_ddpx import DistributedDataParallel as OursDDP

    contenders = _contenders(config)
    classes = {"torch": TorchDDP, "ours": OursDDP}
    if config.before:
        from benchmarks.snapshot_package import snapshot_module_class

        classes["before"] = snapshot_module_class(config.before)
    for alternative in _alternatives(config):
        classes[alternative] = OursDDP
    # Subnormal floats can make CPU arithmetic 10-100x slower at random points as weights drift; flushing them
    # keeps the arithmetic cost constant so that only the data-parallel machinery differs between contenders.
    torch.set_flush_denormal(True)
    modules = {name: build_model(config.model, config.seed) for name in contenders}
    gbv = config.gradient_as_bucket_view
    # Default bucket sizes and flags on all; only gradient_as_bucket_view is varied (and the same on all).
    wrapped = {name: classes[name](modules[name], gradient_as_bucket_view=gbv) for name in contenders}
    if config.halves:  # the alternative injected on every rank before the first step
        from benchmarks.alt_transports import MeanAllReduceInHalves

        wrapped["halves"].reducer.use_transport(MeanAllReduceInHalves(wrapped["halves"].process_group))
    if config.gloo:
        from lightning_ddpx.engine.transport.transports import MeanAllReduce

        wrapped["gloo"].reducer.use_transport(MeanAllReduce(wrapped["gloo"].process_group))
    if config.noop:
        for ddp in wrapped.values():
            ddp.register_comm_hook(None, noop_hook)
    batch = make_batch(config.model, rank, config.seed)
    steps = {
        name: make_train_step(wrapped[name], torch.optim.SGD(wrapped[name].parameters(), lr=config.lr), batch)
        for name in contenders
    }

    reducer = getattr(wrapped["ours"], "reducer", None)
    exposed_comm_s: list[float] = []

    def record_exposed_comm() -> None:  # how long finalize waited for communication (our reducer only)
        exposed_comm_s.append(float(getattr(reducer, "last_exposed_comm_s", float("nan"))))

    def report_round(r: int, rounds: int, times: dict[str, list[float]]) -> None:
        if rank == 0 and config.verbose:
            parts = [f"{name} " + " ".join(f"{1e3 * t:7.1f}" for t in times[name]) for name in contenders]
            print(f"  {config.model} round {r + 1:3d}/{rounds}  " + "  | ".join(parts) + "  ms", flush=True)

    gc.collect()
    cpu_times: dict[str, list[float]] = {}
    page_faults: dict[str, list[int]] = {}
    times = interleaved_timing(
        steps,
        timed_steps=config.steps,
        warmup_steps=config.warmup,
        block=config.block,
        on_block=report_round,
        after_step={"ours": record_exposed_comm},
        cpu_times=cpu_times,
        page_faults=page_faults,
    )
    tensors, numel = parameter_summary(modules["ours"])
    return {
        "rank": rank,
        "times_s": times,
        "cpu_s": cpu_times,
        "page_faults": page_faults,
        "ours_exposed_comm_s": exposed_comm_s,
        # Same init, same batches, same arithmetic: the copies must still agree, or the comparison is unfair.
        "param_max_abs_diff": max(max_param_diff(modules["torch"], modules[name]) for name in contenders[1:]),
        "param_tensors": tensors,
        "param_numel": numel,
        "ours_buckets": len(wrapped["ours"].bucket_plan()),
        "ours_launcher": type(reducer.transport.launcher).__name__,
    }


def _summed_over_ranks(per_rank: list[dict[str, Any]], key: str, contender: str) -> list[float]:
    """One per-step measure (``cpu_s``, ``page_faults``) summed over the ranks: what the whole job spent on
    each timed step."""
    return [sum(step) for step in zip(*(rank[key][contender] for rank in per_rank))]


def _contenders(config: RunConfig) -> tuple[str, ...]:
    return CONTENDERS + (("before",) if config.before else ()) + _alternatives(config)


def _alternatives(config: RunConfig) -> tuple[str, ...]:
    """Contenders that are ours with another transport injected (benchmarks/alt_transports.py)."""
    return tuple(name for name, wanted in (("halves", config.halves), ("gloo", config.gloo)) if wanted)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every requested model in its own 2-process job, print the live rounds and the final table.

    Returns the JSON-able results (also written to ``args.json`` when given).
    """
    mode = "noop hook on both (compute-only ceiling)" if args.noop else "default allreduce"
    if args.gradient_as_bucket_view:
        mode += ", gradient_as_bucket_view=True"
    print(
        f"lightning_ddpx vs torch DDP: {args.world_size} processes, gloo on 127.0.0.1, 1 thread each; {mode}; "
        f"{args.steps} timed steps each after {args.warmup} warm-up, blocks of {args.block}",
        flush=True,
    )
    env = environment_info()
    results: dict[str, Any] = {"config": vars(args).copy(), "mode": mode, "environment": env, "models": {}}
    rows = []
    for name in args.models:
        spec = MODELS[name]
        print(f"\n[{name}] {spec.description}", flush=True)
        config = RunConfig(
            model=name,
            steps=args.steps,
            warmup=args.warmup,
            block=args.block,
            noop=args.noop,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
            before=args.before,
            halves=args.halves,
            gloo=args.gloo,
            lr=args.lr,
            seed=args.seed,
            verbose=not args.quiet,
        )
        per_rank = launch(run_rank, (config,), world_size=args.world_size, timeout_s=args.timeout)
        rank0 = per_rank[0]
        summary = summarize_pair(rank0["times_s"]["torch"], rank0["times_s"]["ours"])
        cpu_s = {c: _summed_over_ranks(per_rank, "cpu_s", c) for c in _contenders(config)}
        faults = {c: _summed_over_ranks(per_rank, "page_faults", c) for c in _contenders(config)}
        mean_faults = {c: sum(steps) / max(len(steps), 1) for c, steps in faults.items()}
        cpu = summarize_pair(cpu_s["torch"], cpu_s["ours"])
        ratio = ratio_interval(rank0["times_s"]["torch"], rank0["times_s"]["ours"], args.block)
        cpu_ratio = ratio_interval(cpu_s["torch"], cpu_s["ours"], args.block)
        target_ratio = TARGET_RATIOS.get(name)
        result = ratio.verdict(target_ratio)
        diff = max(r["param_max_abs_diff"] for r in per_rank)
        exposed = sorted(rank0["ours_exposed_comm_s"])
        exposed_median_ms = 1e3 * exposed[len(exposed) // 2] if exposed else float("nan")
        print(
            f"[{name}] {rank0['param_tensors']} tensors, {rank0['param_numel'] / 1e6:.2f}M params, "
            f"ours: {rank0['ours_buckets']} buckets, {rank0['ours_launcher']}, median exposed comm "
            f"{exposed_median_ms:.1f} ms; torch {summary.baseline_ms:.1f} ms, "
            f"ours {summary.candidate_ms:.1f} ms, "
            f"ratio {ratio}; CPU of all ranks per step: torch "
            f"{cpu.baseline_ms:.1f} ms, ours {cpu.candidate_ms:.1f} ms, ratio {cpu_ratio}; "
            "minor page faults per step (all ranks, "
            f"mean): " + ", ".join(f"{c} {count:.0f}" for c, count in mean_faults.items()),
            flush=True,
        )
        if config.before:
            before = summarize_pair(rank0["times_s"]["torch"], rank0["times_s"]["before"])
            after = summarize_pair(rank0["times_s"]["before"], rank0["times_s"]["ours"])
            after_cpu = summarize_pair(cpu_s["before"], cpu_s["ours"])
            print(
                f"[{name}] before/torch {before.ratio:.3f} [p25 {before.ratio_p25:.3f}, p75 {before.ratio_p75:.3f}], "
                f"ours/before {after.ratio:.3f} [p25 {after.ratio_p25:.3f}, p75 {after.ratio_p75:.3f}; 95 % "
                f"{after.ratio_ci_low:.3f}-{after.ratio_ci_high:.3f}], CPU ours/before {after_cpu.ratio:.3f} "
                f"[95 % {after_cpu.ratio_ci_low:.3f}-{after_cpu.ratio_ci_high:.3f}]",
                flush=True,
            )
            results.setdefault("before", {})[name] = {
                "before_ms": [1e3 * t for t in rank0["times_s"]["before"]],
                "before_vs_torch": asdict(before),
                "ours_vs_before": asdict(after),
                "ours_vs_before_cpu": asdict(after_cpu),
            }
        for alternative in _alternatives(config):
            pair = summarize_pair(rank0["times_s"]["ours"], rank0["times_s"][alternative])
            print(
                f"[{name}] {alternative}/ours {pair.ratio:.3f} [p25 {pair.ratio_p25:.3f}, p75 {pair.ratio_p75:.3f}]",
                flush=True,
            )
            results.setdefault(alternative, {})[name] = {
                f"{alternative}_ms": [1e3 * t for t in rank0["times_s"][alternative]],
                f"{alternative}_vs_ours": asdict(pair),
            }
        if diff != 0.0:
            print(
                f"[{name}] WARNING: torch's and our model copies differ by {diff:.3g} after the run: the two "
                "contenders did not do identical arithmetic.",
                flush=True,
            )
        results["models"][name] = {
            "description": spec.description,
            "param_tensors": rank0["param_tensors"],
            "param_numel": rank0["param_numel"],
            "torch_ms": [1e3 * t for t in rank0["times_s"]["torch"]],
            "ours_ms": [1e3 * t for t in rank0["times_s"]["ours"]],
            "ours_exposed_comm_ms": [1e3 * t for t in rank0["ours_exposed_comm_s"]],
            "ours_buckets": rank0["ours_buckets"],
            "ours_launcher": rank0["ours_launcher"],
            "param_max_abs_diff": diff,
            "summary": asdict(summary),
            "ratio": asdict(ratio),  # the headline: median over rounds, 95 % interval (ratio_interval)
            "cpu_ratio": asdict(cpu_ratio),
            "torch_cpu_ms": [1e3 * t for t in cpu_s["torch"]],
            "ours_cpu_ms": [1e3 * t for t in cpu_s["ours"]],
            "cpu_summary": asdict(cpu),
            "page_faults_per_step": mean_faults,
            "target_ratio": target_ratio,
            "result": result,
        }
        target = "-" if target_ratio is None else f"<= {target_ratio:.2f}"
        rows.append(
            [
                name,
                f"{summary.baseline_ms:.1f}",
                f"{summary.candidate_ms:.1f}",
                f"{ratio.median:.3f}",
                f"{ratio.low:.3f}-{ratio.high:.3f}",
                f"{100 * ratio.half_width:.1f}",
                f"{cpu_ratio.median:.3f} ({cpu_ratio.low:.3f}-{cpu_ratio.high:.3f})",
                target,
                result,
            ]
        )
    print(
        f"\nSummary ({mode}; {args.steps} interleaved steps each; "
        f"ratio = median over {-(-args.steps // args.block)} interleaved rounds of ours/torch, with its 95 % "
        "interval (+- %: its half width); CPU ratio: the same for the CPU time all ranks spent per step; "
        "PASS: the interval's upper end is under the target, UNRESOLVED: the interval holds it):"
    )
    print(
        format_table(
            [
                "model",
                "torch ms (median)",
                "ours ms (median)",
                "ratio",
                "ratio 95 %",
                "+- %",
                "CPU ratio (95 %)",
                "target",
                "result",
            ],
            rows,
        ),
        flush=True,
    )
    write_json(args.json, results)
    if args.json:
        print(f"results written to {args.json}")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=[",".join(DEFAULT_MODELS)],
        help=f"space- or comma-separated, from {', '.join(MODELS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=750,
        help="timed steps per contender: 150 rounds of 5, which resolve the ratio to about +-2 %% on a 2-core "
        "machine at load 1-2 (benchmarks/rounds_needed.py; docs/benchmarks.md) (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="untimed steps per contender first; >= 2 covers the bucket rebuild (default: %(default)s)",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=5,
        help="steps of one contender before switching to the other (default: %(default)s)",
    )
    parser.add_argument(
        "--noop",
        action="store_true",
        help="register torch's debugging noop_hook on both: no communication, compute-only ceiling",
    )
    parser.add_argument(
        "--gradient-as-bucket-view", action="store_true", help="pass gradient_as_bucket_view=True to both"
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument(
        "--before",
        metavar="DIR",
        help="a third contender: lightning_ddpx_before from DIR (benchmarks/snapshot_package.py)",
    )
    parser.add_argument(
        "--halves",
        action="store_true",
        help="a contender: ours with large buckets reduced in halves (benchmarks/alt_transports.py)",
    )
    parser.add_argument(
        "--gloo",
        action="store_true",
        help="a contender: ours summing over gloo (MeanAllReduce injected) where it would use shared memory",
    )
    parser.add_argument(
        "--steady-allocator",
        action="store_true",
        help=f"start the ranks with GLIBC_TUNABLES={STEADY_ALLOCATOR} (docs/benchmarks.md: the allocator's lottery)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per model's job")
    parser.add_argument("--json", metavar="PATH", help="write every step time and the summary here")
    parser.add_argument("--quiet", action="store_true", help="do not print each round's step times")
    args = parser.parse_args(argv)
    args.models = model_names(parser, args.models)
    if args.steps < 1 or args.block < 1 or args.warmup < 0:
        parser.error("--steps and --block must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point: parse ``argv`` (default: the command line) and run the benchmark; returns the results."""
    args = parse_args(argv)
    if args.steady_allocator:  # read by glibc when each rank's process starts (the ranks are spawned)
        os.environ["GLIBC_TUNABLES"] = STEADY_ALLOCATOR
    return run_benchmark(args)


if __name__ == "__main__":
    main()
