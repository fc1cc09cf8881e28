"""Sweep DiLoCo settings on one task over loopback: final validation loss at equal steps, bytes per step.

    python benchmarks/sweep_diloco.py --task digits --steps 160 \\
        --settings '{"period": 50, "precision": "bf16"}' '{"period": 50, "precision": "bf16", "outer_lr": 0.5}'

Each setting is one ``Trainer.fit`` on 2 processes over loopback (losses and bytes do not depend on the link,
only times do), validated every ``--val-every`` steps on the global (outer) model. One JSON line per run is
appended to ``--out``: the setting, the final validation loss and accuracy (mean of the last two validations,
as the convergence benchmark computes them), the mean bytes per step and the curve. ``torch-ddp`` as a
setting runs torch's DDP, the reference.

    python benchmarks/sweep_diloco.py --table benchmarks/results/convergence/diloco_sweep.md \
        --out benchmarks/results/convergence/diloco_sweep.jsonl

writes the table of every setting in ``--out`` against torch's DDP on the same seeds (paired: the same seed is
the same initial model and data order for both): the final loss as the benchmark takes it (mean of the
validations at steps N-20 and N), and for runs validated more often (``--val-every 5``) also the mean of every
validation in the last 20 steps, the same window sampled more densely. Per setting: the ratio of the seed
means less one with its standard error (delta method), and the mean of the per-seed differences with theirs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment_info  # noqa: E402
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
    received = [b for b in record.get("bytes_received", []) if b is not None]
    return {
        "task": task,
        "setting": setting if setting is not None else "torch-ddp",
        "evaluate": evaluate,
        "seed": seed,
        "steps": steps,
        "val_every": val_every,
        "final_val_loss": sum(v["val_loss"] for v in val[-2:]) / len(val[-2:]),
        "final_val_acc": sum(v["metric"] for v in val[-2:]) / len(val[-2:]),
        "bytes_per_step": sum(sent) / len(sent),
        "bytes_vs_ddp": record["gradient_bytes"] / (sum(sent) / len(sent)) if sum(sent) else None,
        # received: an all-reduce's result (the payload's size); the sparse exchange's all-gather, every
        # other rank's payload. torch's DDP receives what it sends.
        "bytes_received_per_step": sum(received) / len(received) if received else None,
        "received_vs_ddp": record["gradient_bytes"] / (sum(received) / len(received))
        if sum(received)
        else None,
        "curve": [(v["step"], round(v["val_loss"], 4), round(v["metric"], 4)) for v in val],
        "wall_s": time.monotonic() - started,
        "loadavg_1min": record["loadavg_1min"],
        "environment": environment_info(),  # the command, the machine and the date of this run
    }


# ------------------------------------------------------------------------------------------------ the table
DEFAULTS = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "fragments": 1, "overlap_steps": 0}


def label(setting: dict) -> str:
    """``H=70, lr=0.7, mom=0.3`` (bf16 unless fp32 is named; F/tau/mix for streaming)."""
    s = {**DEFAULTS, "mixing": 0.0, "precision": "fp32", **setting}
    parts = [f"H={s['period']}"]
    if s["fragments"] > 1:
        parts += [f"F={s['fragments']}", f"tau={s['overlap_steps']}"]
        if s["overlap_steps"]:  # mixing applies to an overlapped exchange only
            parts.append(f"mix={s['mixing']}")
    parts += [f"lr={s['outer_lr']}", f"mom={s['outer_momentum']}"]
    if not s["nesterov"]:
        parts.append("nesterov=False")
    sparse = s.get("sparse")
    if sparse:
        sparse = {
            "density": 0.02,
            "bits": 2,
            "chunk": 4096,
            "error_decay": 0.999,
            **(sparse if isinstance(sparse, dict) else {}),
        }
        parts.append(
            f"sparse {100 * sparse['density']:g} % x {sparse['bits']} bits/{sparse['chunk']}, "
            f"decay {sparse['error_decay']}"
        )
    elif s["precision"] != "bf16":
        parts.append(s["precision"])
    return ", ".join(parts)


def final_losses(row: dict) -> tuple[float | None, float | None]:
    """(the benchmark's final loss: mean of the validations at steps N-20 and N; the mean of every validation
    in [N-20, N]) from the run's curve."""
    steps = row["steps"]
    by_step = {step: loss for step, loss, _ in row["curve"]}
    ends = [by_step[s] for s in (steps - 20, steps) if s in by_step]
    if [step for step, _, _ in row["curve"][-2:]] == [steps - 20, steps]:
        ends = [row["final_val_loss"]] * 2  # unrounded
    window = [loss for step, loss, _ in row["curve"] if steps - 20 <= step <= steps]
    return (sum(ends) / len(ends) if len(ends) == 2 else None), (
        sum(window) / len(window) if window else None
    )


def _t95(n: int) -> float:
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, n - 1))
    except ImportError:  # pragma: no cover - scipy comes with scikit-learn, which the tasks need
        return 1.96


def paired(ours: list[float], ddp: list[float]) -> dict:
    """Ratio of the means less one, its standard error (delta method) and 95 % interval; the same for the mean
    of the per-seed relative differences."""
    n = len(ours)
    mean_o, mean_d = sum(ours) / n, sum(ddp) / n
    ratio = mean_o / mean_d
    out = {"n": n, "ratio": ratio - 1, "ratio_se": None, "diff": None, "diff_se": None, "t95": None}
    diffs = [o / d - 1 for o, d in zip(ours, ddp)]
    out["diff"] = sum(diffs) / n
    out["diffs"] = diffs
    if n > 1:
        resid = [o - ratio * d for o, d in zip(ours, ddp)]
        out["ratio_se"] = math.sqrt(sum(r * r for r in resid) / (n - 1) / n) / mean_d
        mean_diff = out["diff"]
        out["diff_se"] = math.sqrt(sum((x - mean_diff) ** 2 for x in diffs) / (n - 1) / n)
        out["t95"] = _t95(n)
    return out


def _seeds(seeds: list[int]) -> str:
    seeds = sorted(seeds)
    if len(seeds) > 3 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def setting_id(task: str, steps: int, every: int, evaluate: str, name: str) -> str:
    """A summary's name without spaces, as the docs' figure markers cite it:
    ``digits/160/5/global/H=20,lr=0.7,mom=0.3,int4``."""
    return "/".join((task, str(steps), str(every), evaluate, name.replace(" ", "")))


def summaries(rows: list[dict]) -> list[dict]:
    """Every DiLoCo setting in ``rows`` against torch's DDP on the same seeds, in the table's order: the seed
    means, the paired ratio with its standard error and 95 % interval, the per-seed differences, the window
    figures (runs validated more often than every 20 steps) and the bytes. The table and the docs' figures
    both read these, so a figure on a page is the one this returns for its results file."""
    ddp: dict[tuple, dict] = {}  # (task, steps, seed, val_every) -> row; later rows win
    groups: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for row in rows:
        seed, every = row.get("seed", 0), row.get("val_every", 20)
        if row["setting"] == "torch-ddp":
            ddp[(row["task"], row["steps"], seed, every)] = row
        else:
            setting = {**DEFAULTS, "mixing": 0.0, "precision": "fp32", **row["setting"]}
            if setting["fragments"] == 1:
                setting["overlap_steps"] = 0  # unused without fragments
            if not setting["overlap_steps"]:
                setting["mixing"] = 0.0  # unused without overlap
            key = (row["task"], row["steps"], every, row["evaluate"], json.dumps(setting, sort_keys=True))
            groups[key][seed] = row
    tasks = sorted({k[0] for k in groups}, key=lambda t: (t != "pydoc-lm", t))
    order = {"global": 0, "local": 1, "mean": 2}

    def sort_key(key: tuple) -> tuple:
        setting = json.loads(key[4])
        return (
            tasks.index(key[0]),
            key[1],
            -key[2],
            order[key[3]],
            setting.get("fragments", 1) > 1,
            label(setting),
        )

    out = []
    for key in sorted(groups, key=sort_key):
        task, steps, every, evaluate, setting = key
        pairs = []
        for seed, row in sorted(groups[key].items()):
            ref = ddp.get((task, steps, seed, every)) or next(
                (r for (t, s, sd, _), r in ddp.items() if (t, s, sd) == (task, steps, seed)), None
            )
            if ref is not None:
                pairs.append((seed, row, ref))
        if not pairs:
            continue
        ours = [final_losses(r) for _, r, _ in pairs]
        refs = [final_losses(r) for _, _, r in pairs]
        bench = paired([o[0] for o in ours], [d[0] for d in refs])
        name = label(json.loads(setting))
        summary = {
            "id": setting_id(task, steps, every, evaluate, name),
            "task": task,
            "steps": steps,
            "val_every": every,
            "evaluate": evaluate,
            "label": name,
            "seeds": [s for s, _, _ in pairs],
            "loss": sum(o[0] for o in ours) / len(ours),
            "ddp_loss": sum(d[0] for d in refs) / len(refs),
            **_interval(bench),
            "diff": bench["diff"],
            "diff_se": bench["diff_se"],
            "per_seed": {str(s): d for (s, _, _), d in zip(pairs, bench["diffs"])},
            "ddp_per_seed": {str(s): d[0] for (s, _, _), d in zip(pairs, refs)},
            "bytes_per_step": sum(r.get("bytes_per_step", 0.0) for _, r, _ in pairs) / len(pairs),
            "window": None,
        }
        if every < 20:
            window = paired([o[1] for o in ours], [d[1] for d in refs])
            summary["window"] = {
                "loss": sum(o[1] for o in ours) / len(ours),
                "ddp_loss": sum(d[1] for d in refs) / len(refs),
                **_interval(window),
            }
        fewer = [r["bytes_vs_ddp"] for _, r, _ in pairs if r.get("bytes_vs_ddp")]
        summary["fewer_sent"] = sum(fewer) / len(fewer) if fewer else None
        fewer = [r["received_vs_ddp"] for _, r, _ in pairs if r.get("received_vs_ddp")]
        summary["fewer_received"] = sum(fewer) / len(fewer) if fewer else None
        out.append(summary)
    return out


def _interval(result: dict) -> dict:
    """The ratio less one, its standard error and its 95 % t interval (None with one seed)."""
    ratio, se, t95 = result["ratio"], result["ratio_se"], result["t95"]
    low, high = (None, None) if se is None else (ratio - t95 * se, ratio + t95 * se)
    return {"ratio": ratio, "ratio_se": se, "low": low, "high": high}


def _pct_of(result: dict) -> str:
    text = f"{100 * result['ratio']:+.1f} %"
    if result["ratio_se"] is not None:
        text += (
            f" ± {100 * result['ratio_se']:.1f} ({100 * result['low']:+.1f} .. {100 * result['high']:+.1f})"
        )
    return text


def table(rows: list[dict]) -> str:
    """The markdown table of every DiLoCo setting against torch's DDP on the same seeds."""
    lines = [
        "| task | steps | val. every | validated | setting | seeds | val_loss (torch's DDP) | vs DDP: ratio of "
        "means ± SE (95 % CI) | per-seed diff.: mean ± SE | window mean (torch's DDP) | window: ratio ± SE "
        "(95 % CI) | x fewer sent | x fewer received |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries(rows):
        window = s["window"]
        cells = [
            s["task"],
            str(s["steps"]),
            str(s["val_every"]),
            s["evaluate"],
            s["label"],
            _seeds(s["seeds"]),
            f"{s['loss']:.4f} ({s['ddp_loss']:.4f})",
            _pct_of(s),
            f"{100 * s['diff']:+.1f} %"
            + (f" ± {100 * s['diff_se']:.1f}" if s["diff_se"] is not None else ""),
            "" if window is None else f"{window['loss']:.4f} ({window['ddp_loss']:.4f})",
            "" if window is None else _pct_of(window),
            "" if s["fewer_sent"] is None else f"{s['fewer_sent']:.0f}",
            "" if s["fewer_received"] is None else f"{s['fewer_received']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


HEADER = """# DiLoCo settings sweep

Over loopback, 2 processes, `steps` steps, validation every `val. every` steps. val_loss: the convergence
benchmark's final loss, the mean of the validations at steps N-20 and N (N = `steps`), averaged over the
seeds; torch's DDP on the same seeds in brackets (the same seed gives both the same initial model and data
order). *vs DDP*: the DiLoCo mean over torch's DDP's mean, less one, with its standard error over the seeds
(delta method) and a 95 % t interval; *per-seed diff.*: the mean of the per-seed relative differences.
*window*: for runs validated every 5 steps, the mean of every validation in [N-20, N] (the same window,
sampled 5 times instead of twice), for both alike. `validated`: global = the outer model (what the benchmark
validates), local = each rank's replica (losses averaged), mean = the replicas' mean (diagnostic). Settings
are bf16 unless `fp32` is named. Written by `benchmarks/sweep_diloco.py --table`; every run with its curve
in `diloco_sweep.jsonl`.

"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--evaluate", default="global", choices=("global", "local", "mean"))
    parser.add_argument("--strategy", default="{}", help="extra DDPXStrategy arguments (JSON)")
    parser.add_argument("--settings", nargs="+", help="DiLoCo options as JSON, or torch-ddp")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, one run each")
    parser.add_argument("--out", default="runs/sweep_diloco.jsonl")
    parser.add_argument(
        "--table", metavar="MD", help="write the table of every run in --out to MD (and print it)"
    )
    args = parser.parse_args()
    if args.table:
        with open(args.out) as f:
            text = HEADER + table([json.loads(line) for line in f if line.strip()])
        with open(args.table, "w") as f:
            f.write(text)
        print(text, end="")
        return
    if not args.settings or not args.task:
        parser.error("--task and --settings are required (or --table)")
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
