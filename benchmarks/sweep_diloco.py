"""Sweep DiLoCo settings on one task over loopback: final validation loss at equal steps, bytes per step.

    python benchmarks/sweep_diloco.py --task digits --steps 160 \\
        --settings '{"period": 50, "precision": "bf16"}' '{"period": 50, "precision": "bf16", "outer_lr": 0.5}'

Each setting is one ``Trainer.fit`` on 2 processes over loopback (losses and bytes do not depend on the link,
only times do), validated every ``--val-every`` steps on the global (outer) model. One JSON line per run is
appended to ``--out``: the setting, the final validation loss and accuracy (mean of the last two validations,
as the convergence benchmark computes them), the mean bytes per step and the curve. ``torch-ddp`` as a
setting runs torch's DDP, the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_ddpx.bench.launch import run_ranks  # noqa: E402


def run_one(
    task: str, setting: dict | None, steps: int, val_every: int, evaluate: str, extra: dict, seed: int = 0
) -> dict:
    strategy = None if setting is None else {"comm_hook": "diloco", "diloco": setting, **extra}
    config = {
        "model": task,
        "datamodule": None,
        "contender": "sweep",
        "strategy": strategy,
        "world_size": 2,
        "max_steps": steps,
        "val_every": val_every,
        "metric": "val_acc",
        "seed": seed,
        "evaluate": evaluate,
    }
    started = time.monotonic()
    try:
        record = run_ranks(config, None, 1800.0, worker="lightning_ddpx.bench.convergence_worker")[0]
    except RuntimeError as error:  # a rank that died at exit (seen with gloo's teardown): once more
        print(f"retrying once: {str(error).splitlines()[0]}", flush=True)
        record = run_ranks(config, None, 1800.0, worker="lightning_ddpx.bench.convergence_worker")[0]
    val = record["val"]
    sent = [b for b in record["bytes_sent"] if b is not None]
    return {
        "task": task,
        "setting": setting if setting is not None else "torch-ddp",
        "evaluate": evaluate,
        "seed": seed,
        "steps": steps,
        "final_val_loss": sum(v["val_loss"] for v in val[-2:]) / len(val[-2:]),
        "final_val_acc": sum(v["metric"] for v in val[-2:]) / len(val[-2:]),
        "bytes_per_step": sum(sent) / len(sent),
        "bytes_vs_ddp": record["gradient_bytes"] / (sum(sent) / len(sent)) if sum(sent) else None,
        "curve": [(v["step"], round(v["val_loss"], 4), round(v["metric"], 4)) for v in val],
        "wall_s": time.monotonic() - started,
        "loadavg_1min": record["loadavg_1min"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", required=True)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--evaluate", default="global", choices=("global", "local", "mean"))
    parser.add_argument("--strategy", default="{}", help="extra DDPXStrategy arguments (JSON)")
    parser.add_argument("--settings", nargs="+", required=True, help="DiLoCo options as JSON, or torch-ddp")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, one run each")
    parser.add_argument("--out", default="runs/sweep_diloco.jsonl")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for text in args.settings:
        for seed in [int(s) for s in args.seeds.split(",")]:
            setting = None if text == "torch-ddp" else json.loads(text)
            extra = json.loads(args.strategy)
            row = run_one(args.task, setting, args.steps, args.val_every, args.evaluate, extra, seed)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{args.task} seed {seed} {text} [{args.evaluate}]: val_loss {row['final_val_loss']:.4f} "
                f"acc {row['final_val_acc']:.4f} x{row['bytes_vs_ddp'] or 0:.0f} fewer B ({row['wall_s']:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
