"""``python -m lightning_ddpx.bench``: which communication hook should *my* model use on *my* network?

    python -m lightning_ddpx.bench --model mlp
    python -m lightning_ddpx.bench --model mypkg.models:build --input-shape 32,1024 --steps 30
    python -m lightning_ddpx.bench --model mlp --link 1gbit --json bench.json --png bench.png   # needs root

    # time to accuracy: Trainer.fit of your LightningModule (+ DataModule) once per contender
    python -m lightning_ddpx.bench --convergence --model mypkg.task:MyModule --datamodule mypkg.task:MyData \
        --max-steps 300 --val-every 25 --link 1gbit --json conv.json --png conv.png
    python -m lightning_ddpx.bench --convergence --model digits      # a built-in task: digits | pydoc-lm
    python -m lightning_ddpx.bench --model mlp --accuracy-from conv.json  # lossy hooks only if they passed

Every hook (and torch's DDP as the reference) trains a copy of the model in the same processes, timed
interleaved in short blocks so that machine noise hits all of them alike. Reported per hook: step time
(median, p25-p75), the ratio to plain allreduce (median of same-round pairs), bytes sent per step, exposed
communication, the known accuracy cost, and one recommendation. A lossy hook (fp16, bf16, PowerSGD) is
recommended only if a ``--convergence`` run (``--accuracy-from``) showed its accuracy within tolerance of
allreduce at equal steps; otherwise the recommendation says it could not check.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from lightning_ddpx.bench.cleanup import exits_through_python
from lightning_ddpx.bench.contenders import START_POWERSGD_ITER, contenders_named
from lightning_ddpx.bench.convergence_cli import (
    add_convergence_arguments,
    check_convergence_arguments,
    convergence_main,
    load_accuracy_verdicts,
)
from lightning_ddpx.bench.launch import run_ranks
from lightning_ddpx.bench.report import recommend, render_table, rows_as_json, summarize, write_chart
from lightning_ddpx.bench.workload import load_workload

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.convergence:
        check_convergence_arguments(parser, args)
        return args
    if args.warmup <= START_POWERSGD_ITER:
        parser.error(
            f"--warmup must be > {START_POWERSGD_ITER} so that only compressed PowerSGD steps are timed"
        )
    if args.steps < 1 or args.block < 1 or args.world_size < 2:
        parser.error("--steps and --block must be >= 1, --world-size >= 2")
    try:
        args.input_shape = [int(d) for d in args.input_shape.split(",")] if args.input_shape else None
        args.hooks = [h.strip() for h in args.hooks.split(",") if h.strip()] if args.hooks else None
        contenders_named(args.hooks)
    except ValueError as error:
        parser.error(str(error))
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_ddpx.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        required=True,
        help="mlp | transformer | many | tiny | package.module:factory; with --convergence: digits | "
        "pydoc-lm | package.module:LightningModuleFactory",
    )
    parser.add_argument(
        "--accuracy-from",
        metavar="JSON",
        help="a --convergence run's --json: lossy hooks it found within tolerance may be recommended",
    )
    parser.add_argument(
        "--input-shape", help="batch shape fed to the model, e.g. 32,1024 (factories without an example)"
    )
    parser.add_argument("--world-size", type=int, default=2, help="processes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per hook (default: %(default)s)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=START_POWERSGD_ITER + 2,
        help="untimed steps per hook first; more than %d so PowerSGD is compressing (default: %%(default)s)"
        % START_POWERSGD_ITER,
    )
    parser.add_argument(
        "--block", type=int, default=3, help="steps of one hook before the next (default: %(default)s)"
    )
    parser.add_argument(
        "--hooks", help="comma-separated subset, e.g. allreduce,fp16,powersgd-r1 (default: all)"
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="(default: %(default)s)")
    parser.add_argument(
        "--link",
        metavar="RATE",
        help="emulate two nodes joined by a link of RATE (e.g. 1gbit, 10gbit; unlimited: no shaping); root only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--png", metavar="PATH", help="write a bar chart here (needs matplotlib)")
    add_convergence_arguments(parser)
    return parser


# SIGTERM (kill, a job scheduler) unwinds like Ctrl-C, so the ranks are stopped and --link's network namespaces
# are removed instead of left behind.
@exits_through_python()
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.convergence:
        return convergence_main(args)
    accuracy = load_accuracy_verdicts(args.accuracy_from) if args.accuracy_from else None
    contenders = contenders_named(args.hooks)
    probe = load_workload(args.model, tuple(args.input_shape or ()) or None, args.seed, rank=0)
    probe.loss(probe.module)  # a model or input that cannot run fails here, before any process starts
    numel = sum(p.numel() for p in probe.module.parameters())
    where = f"a {args.link} veth link between two network namespaces" if args.link else "loopback (127.0.0.1)"
    print(
        f"lightning_ddpx.bench: {args.model}, {numel / 1e6:.2f}M parameters; {args.world_size} processes over "
        f"{where}; {len(contenders)} hooks x ({args.warmup} warm-up + {args.steps} timed steps), interleaved",
        flush=True,
    )
    config = {
        "model": args.model,
        "input_shape": args.input_shape,
        "world_size": args.world_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "block": args.block,
        "contenders": [c.name for c in contenders],
        "bucket_cap_mb": args.bucket_cap_mb,
        "seed": args.seed,
        "pg_timeout_s": 600,
    }
    started = time.monotonic()
    per_rank = run_ranks(config, args.link, args.timeout)
    rows = summarize(contenders, per_rank[0])
    advice = recommend(contenders, rows, accuracy)
    print("\n" + render_table(rows) + "\n\n" + advice, flush=True)
    result = {
        "config": config,
        "link": args.link,
        "wall_s": time.monotonic() - started,
        "param_numel": numel,
        "rows": rows_as_json(rows),
        "recommendation": advice,
        "step_times_s": per_rank[0]["times_s"],
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results: {args.json}")
    if args.png:
        title = f"{args.model}, {args.world_size} processes, {args.link or 'loopback'}"
        problem = write_chart(rows, title, args.png)
        print(problem or f"chart: {args.png}")
    print(f"({result['wall_s']:.0f} s)")
    return result
