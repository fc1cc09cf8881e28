"""Step time of each communication hook, ours against torch's, on a 2-process CPU gloo job.

    python benchmarks/bench_hooks.py                                  # mlp and transformer, every contender
    python benchmarks/bench_hooks.py --models mlp --steps 90 --json hooks.json
    python benchmarks/bench_hooks.py --quick                          # smoke run: tiny model, a few steps

Contenders, each on its own copy of the model (same seed) with its own SGD optimizer, all in the same two
processes and timed interleaved in short blocks (see ``benchmarks.common.interleaved_timing``):

- ``torch-allreduce``: torch's DDP, no hook (torch's built-in allreduce): the baseline of every ratio;
- ``torch-fp16``: torch's DDP + torch's ``fp16_compress_hook``;
- ``torch-powersgd-r1``: torch's DDP + torch's ``powerSGD_hook``, rank 1, ``start_powerSGD_iter=2``, with
  ``bucket_cap_mb`` large enough for ONE bucket (torch's PowerSGD aborts with a collective mismatch on gloo
  CPU when there are several buckets);
- ours (``lightning_ddpx.DistributedDataParallel`` + ``lightning_ddpx.hooks.build_comm_hook(name, ...)``;
  ``ours-allreduce`` registers the ``allreduce`` hook, unlike the CLI's ``allreduce``, which registers none):
  ``ours-allreduce``, ``ours-fp16``, ``ours-bf16`` (default bucket layout, as torch's allreduce and fp16);
  ``ours-powersgd-r1``, ``ours-powersgd-r4``, ``ours-batched-r1`` (PowerSGD, ``start_powerSGD_iter=2``, in the
  same single-bucket layout as torch's PowerSGD so that the comparison is like for like); ``ours-noop`` (no
  communication at all: the compute-only ceiling).

The warm-up always goes past ``start_powerSGD_iter``, so every timed PowerSGD step is a compressed step
(checked against the hooks' own iteration counters after the run). Ratios that matter:

    ours-powersgd-r1 / torch-powersgd-r1   target <= 0.80
    ours-fp16        / torch-fp16          target <= 1.00
    ours-bf16        / torch-fp16          target <= 1.00   (torch's bf16 hook refuses gloo)
    every contender  / torch-allreduce     no target: where each hook stands

Each ratio is the median over same-round step pairs of candidate/baseline (``common.summarize_pair``).
Targets apply to the real models only (not to ``tiny``, which only exercises the script).

The contenders are ``lightning_ddpx.bench.contenders.Contender`` entries wrapped by its ``wrap``, as in
``python -m lightning_ddpx.bench``; this table adds torch's hooks and the single-bucket layout.
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
    percentile,
    summarize_pair,
    verdict,
    write_json,
)
from lightning_ddpx.bench.contenders import START_POWERSGD_ITER, Contender, wrap  # noqa: E402

DEFAULT_MODELS = ("mlp", "transformer")
# Large enough that every benchmark model's gradients fit in one bucket (the MLP's are ~80 MiB).
SINGLE_BUCKET_MB = 1024.0
BASELINE = "torch-allreduce"

# Torch's contenders take torch's hooks; the PowerSGD ones (both sides) one bucket for the whole model.
CONTENDERS: tuple[Contender, ...] = (
    Contender("torch-allreduce", None, torch_ddp=True),
    Contender("torch-fp16", "fp16", torch_ddp=True),
    Contender("torch-powersgd-r1", "powersgd", 1, torch_ddp=True, bucket_cap_mb=SINGLE_BUCKET_MB),
    Contender("ours-allreduce", "allreduce"),
    Contender("ours-fp16", "fp16"),
    Contender("ours-bf16", "bf16"),
    Contender("ours-powersgd-r1", "powersgd", 1, bucket_cap_mb=SINGLE_BUCKET_MB),
    Contender("ours-powersgd-r4", "powersgd", 4, bucket_cap_mb=SINGLE_BUCKET_MB),
    Contender("ours-batched-r1", "batched_powersgd", 1, bucket_cap_mb=SINGLE_BUCKET_MB),
    Contender("ours-noop", "noop"),
)

# (candidate, baseline, target): the comparisons the hooks are judged by.
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("ours-powersgd-r1", "torch-powersgd-r1", 0.80),
    ("ours-fp16", "torch-fp16", 1.00),
    ("ours-bf16", "torch-fp16", 1.00),
)

# Pairs that do the same arithmetic: their model copies are compared after the run (information only;
# allreduce must agree exactly, fp16 should, PowerSGD only within float rounding, which SGD accumulates).
SAME_ARITHMETIC: tuple[tuple[str, str], ...] = (
    ("torch-allreduce", "ours-allreduce"),
    ("torch-fp16", "ours-fp16"),
    ("torch-powersgd-r1", "ours-powersgd-r1"),
)


@dataclass(frozen=True)
class RunConfig:
    """Everything one 2-process job needs; identical on both ranks, so both do identical work."""

    model: str
    steps: int
    warmup: int
    block: int
    lr: float
    seed: int
    verbose: bool


def _torch_bucket_count(ddp: torch.nn.Module) -> int | None:
    """Buckets torch's DDP uses now (from its logging data; None if this torch does not report them)."""
    try:
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes")
    except Exception:  # noqa: BLE001 - private API, diagnostics only
        return None
    if isinstance(sizes, str):
        return len([s for s in sizes.split(",") if s.strip()])
    return None


def run_rank(rank: int, world_size: int, config: RunConfig) -> dict[str, Any]:
    """Body of one rank: wrap one copy of the model per contender and time them all interleaved."""
    torch.set_flush_denormal(True)  # see bench_engine: subnormals would add noise unrelated to the hooks
    modules = {c.name: build_model(config.model, config.seed) for c in CONTENDERS}
    wrapped: dict[str, torch.nn.Module] = {}
    states: dict[str, Any] = {}
    for contender in CONTENDERS:  # same order on both ranks: the constructors broadcast parameters
        # bucket_cap_mb=None: the constructors' default layout, unless the contender fixes one
        wrapped[contender.name], states[contender.name] = wrap(contender, modules[contender.name], None)
    batch = make_batch(config.model, rank, config.seed)
    steps = {
        name: make_train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=config.lr), batch)
        for name, ddp in wrapped.items()
    }

    exposed_comm_s: dict[str, list[float]] = {}
    after_step = {}
    for contender in CONTENDERS:
        if not contender.ours:
            continue
        reducer = getattr(wrapped[contender.name], "reducer", None)
        samples = exposed_comm_s[contender.name] = []

        def record(reducer: Any = reducer, samples: list[float] = samples) -> None:
            samples.append(float(getattr(reducer, "last_exposed_comm_s", float("nan"))))

        after_step[contender.name] = record

    def report_round(r: int, rounds: int, times: dict[str, list[float]]) -> None:
        if rank == 0 and config.verbose:
            parts = [f"{name} " + " ".join(f"{1e3 * t:.1f}" for t in times[name]) for name in times]
            print(f"  {config.model} round {r + 1:3d}/{rounds}  " + " | ".join(parts) + "  ms", flush=True)

    gc.collect()
    times = interleaved_timing(
        steps,
        timed_steps=config.steps,
        warmup_steps=config.warmup,
        block=config.block,
        on_block=report_round,
        after_step=after_step,
    )

    # Every timed PowerSGD step must have been compressed: the hook's own counter, minus the timed steps,
    # gives the iteration of the first timed step.
    powersgd: dict[str, dict[str, Any]] = {}
    for contender in CONTENDERS:
        if contender.rank is None:
            continue
        state = states[contender.name]
        first_timed_iter = int(state.iter) - config.steps
        if first_timed_iter < START_POWERSGD_ITER:
            raise RuntimeError(
                f"{contender.name}: the first timed step was iteration {first_timed_iter}, before "
                f"start_powerSGD_iter={START_POWERSGD_ITER}: uncompressed steps were timed (raise --warmup)"
            )
        info: dict[str, Any] = {"iterations": int(state.iter), "first_timed_iter": first_timed_iter}
        if contender.ours:
            stats = state.compression_stats()
            info["compression_rate"] = stats.compression_rate
            info["per_step_numel_before"] = sum(b for b, _ in stats.per_bucket.values())
            info["per_step_numel_after"] = sum(a for _, a in stats.per_bucket.values())
        else:
            info["error_buckets"] = len(getattr(state, "error_dict", {}))
        powersgd[contender.name] = info

    buckets: dict[str, int | None] = {}
    for contender in CONTENDERS:
        ddp = wrapped[contender.name]
        buckets[contender.name] = len(ddp.bucket_plan()) if contender.ours else _torch_bucket_count(ddp)
    tensors, numel = parameter_summary(modules[BASELINE])
    result = {
        "rank": rank,
        "times_s": times,
        "exposed_comm_s": exposed_comm_s,
        "param_max_abs_diff": {
            f"{a} vs {b}": max_param_diff(modules[a], modules[b]) for a, b in SAME_ARITHMETIC
        },
        "param_tensors": tensors,
        "param_numel": numel,
        "buckets": buckets,
        "powersgd": powersgd,
    }
    for contender in CONTENDERS:
        if contender.ours:
            wrapped[contender.name].close()  # stop the communication threads before the group goes away
    return result


def _ms_stats(samples_s: list[float]) -> dict[str, float]:
    ms = [1e3 * t for t in samples_s]
    return {"median_ms": percentile(ms, 50), "p25_ms": percentile(ms, 25), "p75_ms": percentile(ms, 75)}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every requested model in its own 2-process job, print the live rounds and the final tables.

    Returns the JSON-able results (also written to ``args.json`` when given).
    """
    print(
        f"communication hooks, ours vs torch: 2 processes, gloo on 127.0.0.1, 1 thread each; "
        f"{len(CONTENDERS)} contenders; {args.steps} timed steps each after {args.warmup} warm-up "
        f"(PowerSGD compresses from iteration {START_POWERSGD_ITER}), blocks of {args.block}",
        flush=True,
    )
    results: dict[str, Any] = {
        "config": vars(args).copy(),
        "environment": environment_info(),
        "contenders": [asdict(c) for c in CONTENDERS],
        "start_powerSGD_iter": START_POWERSGD_ITER,
        "single_bucket_mb": SINGLE_BUCKET_MB,
        "models": {},
    }
    tables: list[str] = []
    for name in args.models:
        spec = MODELS[name]
        print(f"\n[{name}] {spec.description}", flush=True)
        config = RunConfig(
            model=name,
            steps=args.steps,
            warmup=args.warmup,
            block=args.block,
            lr=args.lr,
            seed=args.seed,
            verbose=not args.quiet,
        )
        per_rank = launch(run_rank, (config,), world_size=2, timeout_s=args.timeout)
        rank0 = per_rank[0]
        times = rank0["times_s"]
        diffs = {
            key: max(r["param_max_abs_diff"][key] for r in per_rank) for key in rank0["param_max_abs_diff"]
        }
        targets_apply = name in TARGET_RATIOS  # not on the smoke-test model

        contenders: dict[str, Any] = {}
        rows = []
        for contender in CONTENDERS:
            stats = _ms_stats(times[contender.name])
            vs_base = summarize_pair(times[BASELINE], times[contender.name])
            exposed = rank0["exposed_comm_s"].get(contender.name, [])
            exposed_ms = 1e3 * percentile(exposed, 50) if exposed else None
            contenders[contender.name] = {
                **stats,
                "step_ms": [1e3 * t for t in times[contender.name]],
                "vs_torch_allreduce": asdict(vs_base),
                "exposed_comm_median_ms": exposed_ms,
                "buckets": rank0["buckets"][contender.name],
                "powersgd": rank0["powersgd"].get(contender.name),
            }
            buckets = rank0["buckets"][contender.name]
            print(
                f"[{name}] {contender.name:18s} median {stats['median_ms']:8.1f} ms  "
                f"[p25 {stats['p25_ms']:.1f}, p75 {stats['p75_ms']:.1f}]  "
                f"buckets {'?' if buckets is None else buckets}"
                + ("" if exposed_ms is None else f"  exposed comm {exposed_ms:.1f} ms"),
                flush=True,
            )
            compression = (rank0["powersgd"].get(contender.name) or {}).get("compression_rate")
            rows.append(
                [
                    contender.name,
                    f"{stats['median_ms']:.1f}",
                    f"{stats['p25_ms']:.1f}-{stats['p75_ms']:.1f}",
                    f"{vs_base.ratio:.3f}",
                    f"{vs_base.ratio_p25:.3f}-{vs_base.ratio_p75:.3f}",
                    "-" if compression is None else f"{compression:.1f}x",
                ]
            )

        target_rows = []
        target_results = []
        for candidate, baseline, target in TARGETS:
            summary = summarize_pair(times[baseline], times[candidate])
            result = verdict(summary.ratio, target if targets_apply else None)
            target_results.append(
                {
                    "candidate": candidate,
                    "baseline": baseline,
                    "target_ratio": target,
                    "applies": targets_apply,
                    "summary": asdict(summary),
                    "result": result,
                }
            )
            target_rows.append(
                [
                    f"{candidate} / {baseline}",
                    f"{summary.baseline_ms:.1f}",
                    f"{summary.candidate_ms:.1f}",
                    f"{summary.ratio:.3f}",
                    f"{summary.ratio_p25:.3f}-{summary.ratio_p75:.3f}",
                    f"{summary.ratio_of_medians:.3f}",
                    f"<= {target:.2f}" if targets_apply else "-",
                    result,
                ]
            )

        for key, diff in diffs.items():
            exact = key.startswith("torch-allreduce")
            note = "" if not exact or diff == 0.0 else "  WARNING: should be 0 (same arithmetic)"
            print(f"[{name}] parameters after the run, {key}: max |diff| {diff:.3g}{note}", flush=True)

        results["models"][name] = {
            "description": spec.description,
            "param_tensors": rank0["param_tensors"],
            "param_numel": rank0["param_numel"],
            "param_max_abs_diff": diffs,
            "contenders": contenders,
            "targets": target_results,
        }
        tables.append(
            f"\n[{name}] {rank0['param_tensors']} tensors, {rank0['param_numel'] / 1e6:.2f}M params; "
            f"{args.steps} interleaved steps per contender\n"
            + format_table(
                ["contender", "median ms", "p25-p75 ms", "/ torch-allreduce", "ratio p25-p75", "compression"],
                rows,
            )
            + "\n\n"
            + format_table(
                [
                    "ratio",
                    "baseline ms",
                    "candidate ms",
                    "ratio",
                    "ratio p25-p75",
                    "ratio of medians",
                    "target",
                    "result",
                ],
                target_rows,
            )
        )

    print("\nSummary (ratio = median over same-round step pairs of candidate/baseline):")
    print("\n".join(tables), flush=True)
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
        default=None,
        help=f"comma-separated, from {', '.join(MODELS)} (default: {','.join(DEFAULT_MODELS)}; --quick: tiny)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per contender (default: 60; --quick: 2)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed steps per contender first; must be > start_powerSGD_iter={START_POWERSGD_ITER} so "
        f"that only compressed PowerSGD steps are timed (default: 5; --quick: {START_POWERSGD_ITER + 1})",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=None,
        help="steps of one contender before switching to the next (default: 3; --quick: 1)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: defaults become --models tiny --steps 2 --warmup 3 --block 1 --quiet "
        "(explicit options still win)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per model's job")
    parser.add_argument("--json", metavar="PATH", help="write every step time and the summary here")
    parser.add_argument("--quiet", action="store_true", help="do not print each round's step times")
    args = parser.parse_args(argv)
    defaults = (
        {"models": "tiny", "steps": 2, "warmup": START_POWERSGD_ITER + 1, "block": 1}
        if args.quick
        else {"models": ",".join(DEFAULT_MODELS), "steps": 60, "warmup": 5, "block": 3}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.quiet = True
    args.models = model_names(parser, args.models)
    if args.steps < 1 or args.block < 1:
        parser.error("--steps and --block must be >= 1")
    if args.warmup <= START_POWERSGD_ITER:
        parser.error(
            f"--warmup must be > start_powerSGD_iter={START_POWERSGD_ITER} (got {args.warmup}): the warm-up "
            "must include a compressed PowerSGD step so that no uncompressed or first compressed step is timed"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point: parse ``argv`` (default: the command line) and run the benchmark; returns the results."""
    return run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
