"""``python -m lightning_ddpx.bench --convergence``: time to accuracy of each contender on the user's task.

Also reads a convergence result back (``--accuracy-from``) for the step-time benchmark's recommendation.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from lightning_ddpx.bench.convergence import (
    TOLERANCE,
    accuracy_verdicts,
    convergence_contenders_named,
    default_target,
    recommend_from_convergence,
    rows_as_json,
    run_convergence,
    summarize_runs,
)
from lightning_ddpx.bench.convergence_report import render_convergence_table, write_curves

__all__ = [
    "add_convergence_arguments",
    "check_convergence_arguments",
    "convergence_main",
    "load_accuracy_verdicts",
]

DEFAULT_CONTENDERS = "torch-ddp,allreduce,fp16,powersgd-r2,powersgd-r4"


def add_convergence_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("time to accuracy (--convergence)")
    group.add_argument(
        "--convergence",
        action="store_true",
        help="train --model (a LightningModule factory or built-in task) to --max-steps once per contender",
    )
    group.add_argument("--datamodule", help="package.module:LightningDataModuleFactory for --model")
    group.add_argument(
        "--max-steps", type=int, default=200, help="steps per contender (default: %(default)s)"
    )
    group.add_argument(
        "--val-every", type=int, default=20, help="validate every N steps (default: %(default)s)"
    )
    group.add_argument("--metric", default="val_acc", help="logged validation metric (default: %(default)s)")
    group.add_argument(
        "--mode", choices=("max", "min"), default="max", help="whether higher --metric is better"
    )
    group.add_argument(
        "--target", type=float, help="metric to reach (default: torch's DDP's final value less --tolerance)"
    )
    group.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help="a lossy hook may end at most this much worse than allreduce at equal steps (default: %(default)s)",
    )


def check_convergence_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_steps < 1 or args.val_every < 1 or args.val_every > args.max_steps:
        parser.error("--max-steps and --val-every must be >= 1, and --val-every <= --max-steps")
    if args.max_steps // args.val_every < 2:
        parser.error("--convergence needs at least two validations: --max-steps >= 2 * --val-every")
    if args.tolerance < 0:
        parser.error(f"--tolerance must be >= 0, got {args.tolerance}")
    names = args.hooks if args.hooks is not None else DEFAULT_CONTENDERS
    try:
        args.hooks = [h.strip() for h in names.split(",") if h.strip()]
        convergence_contenders_named(args.hooks)
    except ValueError as error:
        parser.error(str(error))


def convergence_main(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_ddpx.bench.convergence_worker import load_task

    contenders = convergence_contenders_named(args.hooks)
    module, _ = load_task(args.model, args.datamodule)  # fails here, before any process starts
    numel = sum(p.numel() for p in module.parameters())
    where = f"a {args.link} veth link" if args.link else "loopback"
    print(
        f"lightning_ddpx.bench --convergence: {args.model}, {numel / 1e6:.2f}M parameters; {args.world_size} "
        f"processes over {where}; {len(contenders)} contenders x {args.max_steps} steps, one after another",
        flush=True,
    )
    started = time.monotonic()
    runs = run_convergence(
        contenders,
        model=args.model,
        datamodule=args.datamodule,
        link=args.link,
        max_steps=args.max_steps,
        val_every=args.val_every,
        metric=args.metric,
        seed=args.seed,
        world_size=args.world_size,
        timeout_s=args.timeout,
    )
    target = args.target if args.target is not None else default_target(runs, args.mode, args.tolerance)
    rows = summarize_runs(contenders, runs, target, args.mode, args.tolerance)
    advice = recommend_from_convergence(rows, args.metric, args.tolerance)
    print("\n" + render_convergence_table(rows, args.metric, target) + "\n\n" + advice, flush=True)
    result = {
        "config": {k: v for k, v in vars(args).items()},
        "link": args.link,
        "target": target,
        "wall_s": time.monotonic() - started,
        "param_numel": numel,
        "rows": rows_as_json(rows),
        "accuracy": accuracy_verdicts(rows),
        "recommendation": advice,
        "runs": runs,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results: {args.json}")
    if args.png:
        link = args.link or "loopback"
        problem = write_curves({link: runs}, args.metric, {link: target}, f"{args.model}, {link}", args.png)
        print(problem or f"plot: {args.png}")
    print(f"({result['wall_s']:.0f} s)")
    return result


def load_accuracy_verdicts(path: str) -> dict[str, bool]:
    """``{contender: within tolerance}`` from a ``--convergence --json`` file (or bench_convergence's)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return {str(k): bool(v) for k, v in data["accuracy"].items()}
    except (OSError, ValueError, KeyError, AttributeError) as error:
        raise SystemExit(
            f"--accuracy-from {path}: not a --convergence result ({error}); "
            "write one with python -m lightning_ddpx.bench --convergence ... --json PATH"
        ) from error
