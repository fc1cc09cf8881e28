"""Host cost of gradient reduction per gradient and per bucket, ours vs torch's DDP, on a CPU (no GPU needed).

    python benchmarks/bench_host_cost.py                        # about 1-2 minutes on 2 cores
    python benchmarks/bench_host_cost.py --quick                # a few seconds: the code paths only
    python benchmarks/bench_host_cost.py --world-size 2 --json benchmarks/results/host_cost_gloo2.json
    python benchmarks/bench_host_cost.py --layers 32 256 --buckets 1 8 32 128
    python benchmarks/bench_host_cost.py --before /tmp/before   # + the package at a commit (snapshot_package.py)

Why: where the CPU sets the pace (a small or narrow model on a fast GPU), a step lasts as long as its host
work, and a reducer's host work is per gradient (the hook each gradient calls) and per bucket (launching its
collective, copying into and out of it, bookkeeping). On a CPU with tiny tensors the kernels cost almost
nothing, so the same host work can be measured here: our reducer in Python against torch's in C++.

What: chains of ``Linear(8, 8)`` (two tensors and 288 bytes of gradients per layer), a short and a long
one in one bucket, and the long one cut into more buckets by a smaller ``bucket_cap_mb`` (the same cap on
both wrappers, so both make the same buckets). The plain chains, torch's DDP and ours step in one process
per rank, interleaved in short blocks (``benchmarks.common.interleaved_timing``). A step is zero_grad,
forward, MSE loss, backward, SGD step, timed in thread CPU time (the calling thread: on the CPU, autograd
and both reducers' hooks run there), process CPU time (all threads, gloo's included) and wall time. In each
round, each wrapper's extra time over its plain chain, on every layout, is fitted as ``fixed +
per_gradient * tensors + per_bucket * buckets`` (:func:`fit_costs`); the median over rounds is printed
with its 95 % interval (``lightning_ddpx.bench.timing.median_interval``). World size 1 (the default): gloo
with nothing to wait for, so what is left is host work; ratios ours/torch of fitted costs are ratios of
medians, with a bootstrap interval (:func:`ratio_of_medians`). With ``--before DIR``, a third wrapper: the
package as ``benchmarks/snapshot_package.py`` wrote it to DIR, fitted the same way and compared with ours
(ours/before). docs/benchmarks.md ("Host cost per bucket and per gradient, without a GPU") has figures.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    environment_info,
    format_table,
    interleaved_timing,
    launch,
    make_train_step,
    parameter_summary,
    percentile,
    ratio_interval,
    write_json,
)
from lightning_ddpx.bench.timing import median_interval  # noqa: E402

WIDTH = 8  # Linear(8, 8): 64 + 8 floats per layer, so kernels cost next to nothing
BATCH = 4
CLOCKS = ("thread", "process", "wall")  # thread CPU (the headline), all threads' CPU, wall
WRAPPERS = ("torch", "ours")  # baseline first: ratios are ours / torch
BEFORE = "before"  # the optional third wrapper (--before): ratios ours / before too
COSTS = ("fixed", "per_gradient", "per_bucket")


@dataclass(frozen=True)
class Layout:
    """One model and bucket size: ``layers`` x Linear(8, 8) cut into about ``buckets`` buckets."""

    layers: int
    buckets: int

    @property
    def name(self) -> str:
        return f"{self.layers}x{self.buckets}"

    def bucket_cap_mb(self) -> float:
        """The cap that cuts the chain's gradients into ``buckets`` equal buckets (both wrappers close a
        bucket once it reaches the cap, and an explicit cap applies to the first bucket too)."""
        return self.layers * (WIDTH * WIDTH + WIDTH) * 4 / self.buckets / 2**20


@dataclass(frozen=True)
class RunConfig:
    """What every rank runs; identical on all ranks, so all do identical work."""

    layouts: tuple[Layout, ...]
    rounds: int
    block: int
    warmup: int
    seed: int
    verbose: bool
    before: str | None = None  # a directory holding snapshot_package.py's lightning_ddpx_before

    @property
    def wrappers(self) -> tuple[str, ...]:
        return WRAPPERS + ((BEFORE,) if self.before else ())


def chain(layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def torch_bucket_count(ddp: nn.parallel.DistributedDataParallel) -> int:
    """How many buckets torch's DDP reduced in its last backward (after its bucket rebuild)."""
    return int(ddp._get_ddp_logging_data()["num_buckets_reduced"])


def with_thread_time(step: Callable[[], None], sink: list[float]) -> Callable[[], None]:
    """``step``, appending the calling thread's CPU seconds of each call to ``sink``: interleaved_timing
    measures wall and whole-process CPU time; the thread's is what a reducer adds to the step's critical
    path (on the CPU, autograd and both reducers' hooks run in the thread that calls backward)."""
    clock = time.thread_time

    def timed() -> None:
        started = clock()
        step()
        sink.append(clock() - started)

    return timed


def run_rank(rank: int, world_size: int, config: RunConfig) -> dict[str, Any]:
    """Body of one rank: the plain chains and both wrappers on every layout, timed interleaved."""
    from lightning_ddpx import DistributedDataParallel

    classes = {"ours": DistributedDataParallel}
    if config.before:
        from benchmarks.snapshot_package import snapshot_module_class

        classes[BEFORE] = snapshot_module_class(config.before)
    torch.set_flush_denormal(True)  # subnormals would make arithmetic slow at random, unrelated to reducers
    generator = torch.Generator().manual_seed(1_000_003 * config.seed + rank)
    batch = (torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))
    models: dict[str, nn.Module] = {}
    for layers in _layer_counts(config):
        models[f"plain/{layers}"] = chain(layers, config.seed)
    for layout in config.layouts:
        cap = layout.bucket_cap_mb()
        models[f"torch/{layout.name}"] = nn.parallel.DistributedDataParallel(
            chain(layout.layers, config.seed), bucket_cap_mb=cap
        )
        for wrapper, cls in classes.items():
            models[f"{wrapper}/{layout.name}"] = cls(chain(layout.layers, config.seed), bucket_cap_mb=cap)
    thread_s: dict[str, list[float]] = {name: [] for name in models}
    steps = {
        name: with_thread_time(
            make_train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), batch), thread_s[name]
        )
        for name, model in models.items()
    }

    def report_round(r: int, rounds: int, _times: dict[str, list[float]]) -> None:
        if rank == 0 and config.verbose and (r + 1) % max(1, rounds // 10) == 0:
            print(f"  round {r + 1}/{rounds}", flush=True)

    gc.collect()
    process_s: dict[str, list[float]] = {}
    wall_s = interleaved_timing(
        steps,
        timed_steps=config.rounds * config.block,
        warmup_steps=config.warmup,
        block=config.block,
        on_block=report_round,
        cpu_times=process_s,
    )
    return {
        "times_s": {
            "thread": {name: times[config.warmup :] for name, times in thread_s.items()},  # timed steps only
            "process": process_s,
            "wall": wall_s,
        },
        "tensors": {str(n): parameter_summary(models[f"plain/{n}"])[0] for n in _layer_counts(config)},
        "buckets": {
            layout.name: {
                "torch": torch_bucket_count(models[f"torch/{layout.name}"]),  # type: ignore[arg-type]
                **{w: len(models[f"{w}/{layout.name}"].bucket_plan()) for w in classes},  # type: ignore[operator]
            }
            for layout in config.layouts
        },
    }


def _layer_counts(config: RunConfig) -> list[int]:
    return sorted({layout.layers for layout in config.layouts})


# ------------------------------------------------------------------------------------------- the cost model
def fit_costs(
    tensors: Sequence[float], buckets: Sequence[float], extra: Sequence[float]
) -> tuple[float, float, float]:
    """Least-squares fit of ``extra = fixed + per_gradient * tensors + per_bucket * buckets`` over layouts:
    (fixed, per_gradient, per_bucket), in ``extra``'s unit.

    The layouts must vary the tensor count at some bucket count and the bucket count at some tensor count,
    or the two costs cannot be told apart: ``ValueError`` then.
    """
    if not len(tensors) == len(buckets) == len(extra):
        raise ValueError(f"need one tensor count, bucket count and time per layout, got {len(tensors)}, "
                         f"{len(buckets)}, {len(extra)}")  # fmt: skip
    design = torch.tensor([[1.0, float(t), float(b)] for t, b in zip(tensors, buckets)], dtype=torch.float64)
    if len(extra) < 3 or int(torch.linalg.matrix_rank(design)) < 3:
        raise ValueError(
            f"layouts (tensors, buckets) {list(zip(tensors, buckets))} cannot separate a per-gradient from a "
            "per-bucket cost: vary the tensor count at one bucket count, and the bucket count at one tensor "
            "count"
        )
    target = torch.tensor([float(e) for e in extra], dtype=torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(design, target).solution.squeeze(1)
    fixed, per_gradient, per_bucket = (float(v) for v in solution)
    return fixed, per_gradient, per_bucket


def round_medians(times: Sequence[float], block: int) -> list[float]:
    """The median of each round's block of steps (``interleaved_timing`` lists them round after round)."""
    return [statistics.median(times[i : i + block]) for i in range(0, len(times), block)]


def with_interval(values: Sequence[float]) -> dict[str, float]:
    """Median of per-round values and its 95 % interval (nan with fewer than 6 rounds)."""
    low, high = median_interval(values)
    return {"median": statistics.median(values), "low": low, "high": high}


def ratio_of_medians(
    numerator: Sequence[float], denominator: Sequence[float], resamples: int = 1000, seed: int = 0
) -> dict[str, float]:
    """``median(numerator) / median(denominator)`` with a 95 % bootstrap interval: rounds resampled with
    replacement, in pairs (entry ``i`` of both lists is one round).

    Why not the median of per-round ratios: a fitted cost of one round is a difference of step times and can
    come out near zero or negative, and a ratio over it is then meaningless; the medians are not. The interval
    is nan where some resample's denominator is not positive (the ratio is then unbounded), or with fewer than
    6 rounds.
    """
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(
            f"need two equally long non-empty lists, got {len(numerator)} and {len(denominator)}"
        )
    below = statistics.median(denominator)
    ratio = statistics.median(numerator) / below if below > 0 else math.nan
    n = len(numerator)
    if n < 6 or math.isnan(ratio):
        return {"median": ratio, "low": math.nan, "high": math.nan}
    generator = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picks = [generator.randrange(n) for _ in range(n)]
        below = statistics.median(denominator[i] for i in picks)
        if below <= 0:
            return {"median": ratio, "low": math.nan, "high": math.nan}
        ratios.append(statistics.median(numerator[i] for i in picks) / below)
    return {"median": ratio, "low": percentile(ratios, 2.5), "high": percentile(ratios, 97.5)}


def analyse(
    times_s: dict[str, list[float]],
    layouts: Sequence[Layout],
    tensors: dict[int, int],
    buckets: dict[str, dict[str, int]],
    block: int,
    wrappers: Sequence[str] = WRAPPERS,
) -> dict[str, Any]:
    """One clock's step times (by contender, round-aligned) -> per-layout medians and ratios, and the fitted
    costs per wrapper, each the median over rounds of one fit per round, in microseconds. With ``before``
    among ``wrappers``, ours is also compared with it (``*_before`` entries: ours / before)."""
    rounds = {name: [1e6 * t for t in round_medians(times, block)] for name, times in times_s.items()}
    count = min(len(r) for r in rounds.values())
    per_layout = {}
    extra: dict[str, dict[str, list[float]]] = {w: {} for w in wrappers}
    for layout in layouts:
        plain = rounds[f"plain/{layout.layers}"]
        for wrapper in wrappers:
            mine = rounds[f"{wrapper}/{layout.name}"]
            extra[wrapper][layout.name] = [m - p for m, p in zip(mine, plain)]
        step = ratio_interval(times_s[f"torch/{layout.name}"], times_s[f"ours/{layout.name}"], block)
        per_layout[layout.name] = {
            "layers": layout.layers,
            "tensors": tensors[layout.layers],
            "buckets": buckets[layout.name],
            "plain_us": statistics.median(plain),
            **{f"{w}_us": statistics.median(rounds[f"{w}/{layout.name}"]) for w in wrappers},
            **{f"{w}_extra_us": with_interval(extra[w][layout.name]) for w in wrappers},
            "step_ratio": {"median": step.median, "low": step.low, "high": step.high, "rounds": step.rounds},
            "extra_ratio": ratio_of_medians(extra["ours"][layout.name], extra["torch"][layout.name]),
        }
        if BEFORE in wrappers:
            step = ratio_interval(times_s[f"{BEFORE}/{layout.name}"], times_s[f"ours/{layout.name}"], block)
            per_layout[layout.name]["step_ratio_before"] = {
                "median": step.median,
                "low": step.low,
                "high": step.high,
                "rounds": step.rounds,
            }
    fits: dict[str, list[tuple[float, float, float]]] = {}
    for wrapper in wrappers:
        tensor_counts = [tensors[layout.layers] for layout in layouts]
        bucket_counts = [buckets[layout.name][wrapper] for layout in layouts]
        fits[wrapper] = [
            fit_costs(tensor_counts, bucket_counts, [extra[wrapper][layout.name][r] for layout in layouts])
            for r in range(count)
        ]
    costs: dict[str, Any] = {}
    for i, cost in enumerate(COSTS):
        costs[cost] = {w: with_interval([fit[i] for fit in fits[w]]) for w in wrappers}
        for base, suffix in (("torch", ""), (BEFORE, "_before")):
            if base not in wrappers:
                continue
            costs[cost][f"ours_minus_{base}"] = with_interval(
                [o[i] - t[i] for o, t in zip(fits["ours"], fits[base])]
            )
            costs[cost][f"ratio{suffix}"] = ratio_of_medians(
                [fit[i] for fit in fits["ours"]], [fit[i] for fit in fits[base]]
            )
    return {"layouts": per_layout, "costs": costs, "rounds": count}


# ------------------------------------------------------------------------------------------------ reporting
def _us(value: dict[str, float], digits: int = 1) -> str:
    """``median [low, high]`` (just the median where there is no interval)."""
    if math.isnan(value["low"]):
        return f"{value['median']:.{digits}f}"
    return f"{value['median']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"


def layout_table(result: dict[str, Any]) -> str:
    rows = []
    before = any("before_us" in layout for layout in result["layouts"].values())
    for layout in result["layouts"].values():
        torch_b, ours_b = layout["buckets"]["torch"], layout["buckets"]["ours"]
        rows.append([
            f"{layout['layers']} x Linear({WIDTH}, {WIDTH})", layout["tensors"],
            ours_b if ours_b == torch_b else f"{ours_b} (torch {torch_b})",
            f"{layout['plain_us']:.0f}", f"{layout['torch_us']:.0f}",
            *([f"{layout['before_us']:.0f}"] if before else []), f"{layout['ours_us']:.0f}",
            _us(layout["torch_extra_us"], 0), *([_us(layout["before_extra_us"], 0)] if before else []),
            _us(layout["ours_extra_us"], 0), _us(layout["step_ratio"], 3), _us(layout["extra_ratio"], 2),
            *([_us(layout["step_ratio_before"], 3)] if before else []),
        ])  # fmt: skip
    header = ["model", "tensors", "buckets", "plain us", "torch us", *(["before us"] if before else []),
              "ours us", "torch - plain", *(["before - plain"] if before else []), "ours - plain",
              "ours/torch step", "ours/torch extra", *(["ours/before step"] if before else [])]  # fmt: skip
    return format_table(header, rows)


def cost_table(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    before = any(BEFORE in result["costs"]["fixed"] for result in results.values())
    for cost, digits in (("per_gradient", 2), ("per_bucket", 1), ("fixed", 0)):
        for clock, result in results.items():
            values = result["costs"][cost]
            rows.append([
                cost.replace("_", " "), clock, _us(values["torch"], digits),
                *([_us(values[BEFORE], digits)] if before else []), _us(values["ours"], digits),
                _us(values["ours_minus_torch"], digits), _us(values["ratio"], 2),
                *([_us(values["ours_minus_before"], digits), _us(values["ratio_before"], 2)] if before else []),
            ])  # fmt: skip
    header = ["cost, us", "clock", "torch", *(["before"] if before else []), "ours", "ours - torch",
              "ours/torch", *(["ours - before", "ours/before"] if before else [])]  # fmt: skip
    return format_table(header, rows)


def step_times_us(times_s: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, list[float]]]:
    """Every timed step, by clock and contender, in microseconds to 0.1 us (the JSON stays small)."""
    return {
        clock: {name: [round(1e6 * t, 1) for t in times] for name, times in by_name.items()}
        for clock, by_name in times_s.items()
    }


def layouts_from(layers: Sequence[int], buckets: Sequence[int]) -> tuple[Layout, ...]:
    """The short chain in the first bucket count, the long chain in every bucket count."""
    small, big = layers
    return (Layout(small, buckets[0]),) + tuple(Layout(big, b) for b in buckets)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    config = RunConfig(
        layouts=layouts_from(args.layers, args.buckets),
        rounds=args.rounds,
        block=args.block,
        warmup=args.warmup,
        seed=args.seed,
        verbose=not args.quiet,
        before=os.path.abspath(args.before) if args.before else None,
    )
    print(
        f"host cost of gradient reduction, ours vs torch's DDP: world size {args.world_size} (gloo, 1 "
        f"thread), {len(config.layouts)} layouts x ({', '.join(config.wrappers)}) + plain, {args.rounds} "
        f"interleaved rounds of {args.block} steps after {args.warmup} warm-up",
        flush=True,
    )
    per_rank = launch(run_rank, (config,), world_size=args.world_size, timeout_s=args.timeout)
    rank0 = per_rank[0]
    tensors = {int(layers): count for layers, count in rank0["tensors"].items()}
    results = {
        clock: analyse(
            rank0["times_s"][clock], config.layouts, tensors, rank0["buckets"], args.block, config.wrappers
        )
        for clock in CLOCKS
    }
    print(
        "\nRank 0's thread CPU time per step, us: medians over rounds; extra time over the plain model and "
        "the ratios ours/torch (of whole steps, and of extra times) with their 95 % intervals:"
    )
    print(layout_table(results["thread"]))
    print(
        "\nFitted costs, us (extra = fixed + per gradient * tensors + per bucket * buckets, one fit per "
        "round; median [95 % interval]):"
    )
    print(cost_table(results), flush=True)
    output = {
        "config": {**vars(args), "layouts": [asdict(layout) for layout in config.layouts]},
        "environment": environment_info(),
        "clocks": results,
        "buckets": rank0["buckets"],
        "tensors": rank0["tensors"],
        "times_us": step_times_us(rank0["times_s"]),
    }
    write_json(args.json, output)
    if args.json:
        print(f"results written to {args.json}")
    return output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds: 6 rounds of 2 steps (smoke run)")
    parser.add_argument(
        "--layers", type=int, nargs=2, default=[16, 128], metavar=("SHORT", "LONG"),
        help="layers of the short and the long chain (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--buckets", type=int, nargs="+", default=[1, 16, 64],
        help="bucket counts of the long chain; the short one gets the first (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--world-size", type=int, default=1, help="ranks (default: %(default)s)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=400,
        help="interleaved rounds; 200 gave the wall-clock step ratio to +-1.4-2.7 %% (host_cost_gloo1.json, over "
        "rounds), so 400 for about +-2 %% (default: %(default)s)",
    )
    parser.add_argument(
        "--block", type=int, default=4, help="steps per contender per round (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps per contender first, >= 2 (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for the whole job")
    parser.add_argument("--json", metavar="PATH", help="write every step time and the summaries here")
    parser.add_argument(
        "--before",
        metavar="DIR",
        help="a third wrapper: lightning_ddpx_before from DIR (benchmarks/snapshot_package.py)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not print progress")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.block, args.warmup = 6, 2, 3
    small, big = args.layers
    if not 0 < small < big:
        parser.error(f"--layers needs 0 < SHORT < LONG, got {small} {big}")
    if len(set(args.buckets)) < 2 or min(args.buckets) < 1 or max(args.buckets) > big:
        parser.error(
            f"--buckets needs at least two different counts from 1 to LONG ({big}), got {args.buckets}"
        )
    if args.rounds < 1 or args.block < 1 or args.warmup < 2 or args.world_size < 1:
        parser.error("--rounds, --block and --world-size must be >= 1, --warmup >= 2 (the bucket rebuild)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point: parse ``argv`` (default: the command line) and run the benchmark; returns the results."""
    return run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
