"""Where does lightning_ddpx spend Python time? Profile our module for a few steps on a 2-process CPU job.

    python benchmarks/profile_engine.py                          # cProfile, model "many" (300 small tensors)
    python benchmarks/profile_engine.py --model many1000         # 1,000 small tensors
    python benchmarks/profile_engine.py --tool torch --steps 5   # torch.profiler table (op level + our labels)
    python benchmarks/profile_engine.py --dump /tmp/ddpx.pstats  # raw cProfile data for snakeviz & co.

Why model "many": with ~300 small gradients, per-parameter Python work (a hook call per gradient, bucket
bookkeeping, finalize) is largest relative to arithmetic, so this is where tuning pays off.

Both ranks run (and profile) the same steps so neither waits on the other for unrelated reasons; rank 0
reports. cProfile sees the calling thread only, which on CPU is also the autograd thread (gradient hooks and
the inline launcher run there); the communication thread used for hooks that are not marked
``collectives_issued_on_call`` is not profiled. cProfile slows Python code down several-fold, so read the
report as proportions, not as step times.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    MODELS,
    build_model,
    format_table,
    launch,
    make_batch,
    make_train_step,
)

PACKAGE_MARKER = os.sep + "lightning_ddpx" + os.sep  # a profiled function belongs to us if its file is here
MODELS_MARKER = os.sep + "lightning_ddpx" + os.sep + "bench" + os.sep  # ...unless it is a benchmark model


@dataclass(frozen=True)
class ProfileConfig:
    model: str
    steps: int
    warmup: int
    tool: str  # "cprofile" or "torch"
    top: int
    gradient_as_bucket_view: bool
    dump: str | None


def profile_rank(rank: int, world_size: int, config: ProfileConfig) -> dict[str, Any]:
    """Warm up (including the bucket rebuild), then profile ``config.steps`` steps of our module."""
    from lightning_ddpx import DistributedDataParallel

    torch.set_flush_denormal(True)
    ddp = DistributedDataParallel(
        build_model(config.model), gradient_as_bucket_view=config.gradient_as_bucket_view
    )
    step = make_train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), make_batch(config.model, rank))
    for _ in range(config.warmup):
        step()
    if config.tool == "torch":
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(config.steps):
                step()
            wall = time.perf_counter() - started
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=config.top)
        return {"wall_s": wall, "report": table}
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(config.steps):
        step()
    profiler.disable()
    wall = time.perf_counter() - started
    if rank == 0 and config.dump:
        profiler.dump_stats(config.dump)
    return {"wall_s": wall, "report": cprofile_report(profiler, config.steps, wall, config.top)}


def _is_ours(filename: str) -> bool:
    return PACKAGE_MARKER in filename and MODELS_MARKER not in filename


def _label(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":  # a builtin, e.g. "<method 'copy_' of 'torch._C.TensorBase' objects>"
        return name
    return f"{os.path.basename(filename)}:{line}({name})"


def _is_user_model(func: tuple[str, int, str]) -> bool:
    """``nn.Module.__call__`` reached from DDP.forward, or a benchmark model's own code (lightning_ddpx/bench):
    the model's own work, not lightning_ddpx's."""
    return func[0].replace(os.sep, "/").endswith("torch/nn/modules/module.py") or MODELS_MARKER in func[0]


def cprofile_report(profiler: cProfile.Profile, steps: int, wall_s: float, top: int) -> str:
    """Per-step summary of lightning_ddpx's own Python time and of the calls it makes out of the package.

    "Self" time of our functions is pure interpreter overhead. "Calls out" is the cumulative time of torch
    functions and builtins (collectives, copies, waits) that our functions call directly, attributed to our
    callers; the call from DDP.forward into the user's module is excluded so the model's forward does not
    count. A callee that calls back into lightning_ddpx (``torch.no_grad``'s decorator wrapping our function)
    counts with its self time only, so our time is not counted twice.
    """
    stats = pstats.Stats(profiler).stats  # {func: (primitive calls, calls, self s, cumulative s, callers)}
    ours = {func: entry for func, entry in stats.items() if _is_ours(func[0])}
    ours_self = sum(entry[2] for entry in ours.values())
    reentrant = {caller for entry in ours.values() for caller in entry[4] if not _is_ours(caller[0])}
    calls_out: dict[tuple[str, int, str], list[float]] = {}  # callee -> [calls, seconds]
    for func, (_, _, _, _, callers) in stats.items():
        if _is_ours(func[0]) or _is_user_model(func):
            continue
        for caller, caller_entry in callers.items():
            if _is_ours(caller[0]):
                acc = calls_out.setdefault(func, [0.0, 0.0])
                acc[0] += caller_entry[1]
                acc[1] += caller_entry[2] if func in reentrant else caller_entry[3]
    out_s = sum(acc[1] for acc in calls_out.values())
    per_step = 1e3 / steps

    lines = [
        f"{steps} profiled steps, {wall_s * per_step:.1f} ms per step under cProfile (inflated by profiling)",
        f"lightning_ddpx Python self time:     {ours_self * per_step:8.2f} ms/step "
        f"({100 * ours_self / wall_s:.1f} % of wall)",
        f"calls out of lightning_ddpx (cum.):  {out_s * per_step:8.2f} ms/step "
        f"({100 * out_s / wall_s:.1f} % of wall; model forward excluded)",
        "",
        f"lightning_ddpx functions by self time (top {top}):",
    ]
    rows = [
        [_label(func), f"{entry[1] / steps:.1f}", f"{entry[2] * per_step:.3f}", f"{entry[3] * per_step:.3f}"]
        for func, entry in sorted(ours.items(), key=lambda item: -item[1][2])[:top]
    ]
    lines.append(format_table(["function", "calls/step", "self ms/step", "cumulative ms/step"], rows))
    lines += ["", f"calls out of lightning_ddpx by cumulative time (top {top}):"]
    rows = [
        [_label(func), f"{calls / steps:.1f}", f"{seconds * per_step:.3f}"]
        for func, (calls, seconds) in sorted(calls_out.items(), key=lambda item: -item[1][1])[:top]
    ]
    lines.append(format_table(["callee", "calls/step", "cumulative ms/step"], rows))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="many", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=20, help="profiled steps (default: %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=3, help="unprofiled steps first, >= 2 (default: %(default)s)"
    )
    parser.add_argument("--tool", choices=("cprofile", "torch"), default="cprofile")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default: %(default)s)")
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    parser.add_argument("--dump", metavar="PATH", help="cProfile only: write rank 0's raw stats here")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.top < 1:
        parser.error("--steps and --top must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> str:
    """Entry point: profile and print rank 0's report; returns it."""
    args = parse_args(argv)
    config = ProfileConfig(
        model=args.model,
        steps=args.steps,
        warmup=args.warmup,
        tool=args.tool,
        top=args.top,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        dump=os.path.abspath(args.dump) if args.dump else None,
    )
    print(f"profiling lightning_ddpx on {MODELS[args.model].description} with {args.tool}", flush=True)
    report = launch(profile_rank, (config,), world_size=2, timeout_s=args.timeout)[0]["report"]
    print(report)
    if config.dump:
        print(f"\nraw stats: {config.dump} (python -m pstats {config.dump})")
    return report


if __name__ == "__main__":
    main()
