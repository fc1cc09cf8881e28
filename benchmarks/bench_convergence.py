"""Does compression pay? Time to accuracy of every contender on two real tasks, over three links.

    python benchmarks/bench_convergence.py                          # everything (root for the links; about an hour)
    python benchmarks/bench_convergence.py --tasks digits --links loopback,1gbit
    python benchmarks/bench_convergence.py --plot-only              # tables and plots from saved results
    python benchmarks/bench_convergence.py --quick                  # smoke run: a few steps, loopback

Each (task, link, contender) is one ``Trainer.fit`` on 2 processes (:mod:`lightning_ddpx.bench.convergence`),
the same number of steps for every contender on a link, same seeds and data. Tasks
(:mod:`lightning_ddpx.bench.tasks`): ``digits`` (CNN on upscaled scikit-learn digits, 6.3M parameters) and
``pydoc-lm`` (word-level transformer on the stdlib's help text, 5.3M parameters). Links: ``loopback``
(127.0.0.1) and two emulated nodes over a veth pair shaped to ``1gbit`` or ``100mbit``
(:mod:`lightning_ddpx.bench.netns`, root only). The slow ``100mbit`` link runs fewer contenders (a lossless
step takes ~1 s there).

Writes ``<out>/<task>_<link>.json`` after every contender (a crash keeps what finished), then per task a
markdown table (``<out>/<task>.md``) and a PNG with one panel per link (``<img>/convergence_<task>.png``).
Target (unless ``--target``): torch's DDP's final validation accuracy on that link, less the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment_info  # noqa: E402
from lightning_ddpx.bench.convergence import (  # noqa: E402
    TOLERANCE,
    accuracy_verdicts,
    convergence_contenders_named,
    default_target,
    recommend_from_convergence,
    rows_as_json,
    run_convergence,
    summarize_runs,
)
from lightning_ddpx.bench.convergence_report import render_convergence_table, write_curves  # noqa: E402

# Steps and validation interval per task: enough for torch's DDP to level off on 2 CPU processes.
TASK_STEPS = {"digits": (240, 20), "pydoc-lm": (320, 20)}
SLOW_LINK_STEPS = {"digits": (160, 20), "pydoc-lm": (160, 20)}  # 100mbit: ~2 s per lossless step
ALL = "torch-ddp,allreduce,fp16,powersgd-r1,powersgd-r2,powersgd-r4,powersgd-r1-noef,powersgd-r2-noef,powersgd-r4-noef,batched-r2"
SLOW_LINK = "torch-ddp,fp16,powersgd-r2,powersgd-r4"
QUICK_STEPS = (8, 4)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="digits,pydoc-lm")
    parser.add_argument("--links", default="loopback,1gbit,100mbit")
    parser.add_argument("--hooks", help=f"contenders on every link (default: all; on 100mbit: {SLOW_LINK})")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--target", type=float, help="one target for every task and link")
    parser.add_argument("--out", default="runs/convergence", help="JSON results and tables")
    parser.add_argument("--img", default="docs/img", help="where the PNGs go")
    parser.add_argument("--plot-only", action="store_true", help="tables and plots from saved JSON")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_STEPS[0]} steps, loopback, 3 contenders"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per contender")
    args = parser.parse_args(argv)
    args.tasks = args.tasks.split(",")
    args.links = args.links.split(",")
    if args.quick:
        args.links = ["loopback"]
        args.hooks = args.hooks or "torch-ddp,allreduce,powersgd-r2"
        args.out = "runs/convergence-quick" if args.out == "runs/convergence" else args.out
        args.img = args.out  # a smoke run never overwrites the docs' figures
    return args


def _path(out: str, task: str, link: str) -> str:
    return os.path.join(out, f"{task}_{link}.json")


def _hooks(args: argparse.Namespace, link: str) -> list[str]:
    return (args.hooks or (SLOW_LINK if link == "100mbit" else ALL)).split(",")


def measure(args: argparse.Namespace, task: str, link: str) -> None:
    contenders = convergence_contenders_named(_hooks(args, link))
    steps, every = QUICK_STEPS if args.quick else (SLOW_LINK_STEPS if link == "100mbit" else TASK_STEPS)[task]
    path = _path(args.out, task, link)
    saved: dict = {"task": task, "link": link, "max_steps": steps, "val_every": every, "runs": {}}
    if os.path.exists(path):  # resume: contenders already measured with these settings are kept
        with open(path) as f:
            old = json.load(f)
        if (old["max_steps"], old["val_every"]) == (steps, every):
            saved = old
    todo = tuple(c for c in contenders if c.name not in saved["runs"])
    print(f"== {task} over {link}: {len(todo)} contenders x {steps} steps", flush=True)

    def done(name: str, record: dict) -> None:
        # each contender with its own machine, load and date
        saved["runs"][name] = {**record, "environment": environment_info()}
        with open(path + ".tmp", "w") as f:
            json.dump(saved, f)
        os.replace(path + ".tmp", path)

    run_convergence(
        todo,
        model=task,
        datamodule=None,
        link=None if link == "loopback" else link,
        max_steps=steps,
        val_every=every,
        timeout_s=args.timeout,
        done=done,
    )


def link_report(saved: dict, target: float | None, tolerance: float) -> tuple[list, list, float, str]:
    """One link's saved runs summarised: the contenders in table order, their summary rows, the target and
    the markdown the docs show (heading line, the table, the recommendation). ``--plot-only`` and the test
    that keeps docs/convergence.md in step with the results both call this."""
    runs = saved["runs"]
    order = convergence_contenders_named(
        [n for n in (c.name for c in convergence_contenders_named(None)) if n in runs]
    )
    target = target if target is not None else default_target(runs, "max", tolerance)
    rows = summarize_runs(order, runs, target, "max", tolerance)
    text = "\n".join(
        [
            f"**{saved['link']}**, {saved['max_steps']} steps, validation every {saved['val_every']}:\n",
            "```",
            render_convergence_table(rows, "val_acc", target),
            "```",
            recommend_from_convergence(rows, "val_acc", tolerance) + "\n",
        ]
    )
    return order, rows, target, text


def report(args: argparse.Namespace, task: str) -> None:
    panels, targets, lines = {}, {}, [f"### {task}\n"]
    for link in args.links:
        path = _path(args.out, task, link)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            saved = json.load(f)
        order, rows, target, text = link_report(saved, args.target, args.tolerance)
        panels[link], targets[link] = {c.name: saved["runs"][c.name] for c in order}, target
        lines.append(text)
        saved["rows"], saved["target"], saved["accuracy"] = (
            rows_as_json(rows),
            target,
            accuracy_verdicts(rows),
        )
        with open(path, "w") as f:
            json.dump(saved, f)
    if not panels:
        return
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(args.out, f"{task}.md"), "w") as f:
        f.write(text)
    png = os.path.join(args.img, f"convergence_{task}.png")
    title = f"{task}: validation accuracy vs training wall time, 2 processes (dotted line: target)"
    print(write_curves(panels, "val_acc", targets, title, png) or f"plot: {png}", flush=True)
    # Accuracy against steps on the link with the most contenders: what each hook's steps are worth.
    link = max(panels, key=lambda name: len(panels[name]))
    png = os.path.join(args.img, f"convergence_{task}_steps.png")
    title = f"{task}: validation accuracy vs step ({link} runs; the link does not change it)"
    print(
        write_curves({link: panels[link]}, "val_acc", {link: targets[link]}, title, png, x="step")
        or f"plot: {png}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.img, exist_ok=True)
    for task in args.tasks:
        if not args.plot_only:
            for link in args.links:
                measure(args, task, link)
        report(args, task)


if __name__ == "__main__":
    main()
