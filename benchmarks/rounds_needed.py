"""How many interleaved rounds resolve the ratio ours/torch to +-2 %: read from bench_engine results files.

    python benchmarks/rounds_needed.py benchmarks/results/engine_gloo2_rooms_before_after.json ... \\
        --json benchmarks/results/engine_rounds_needed.json

For every model of every file, the ratio and its 95 % interval over the run's rounds
(``lightning_ddpx.bench.timing.ratio_interval``, the rule the benchmarks follow) and the rounds that would
narrow it to +-2 %: the interval's width goes as 1/sqrt(rounds), so ``rounds * (half_width / 0.02) ** 2``.
Each entry keeps the environment its run recorded (machine, load, date): the rounds needed grow with the
machine's noise. ``bench_engine.py``'s default ``--steps`` comes from this (docs/benchmarks.md, "How many
rounds").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment_info, format_table, write_json  # noqa: E402
from lightning_ddpx.bench.timing import ratio_interval  # noqa: E402

RESOLUTION = 0.02  # the half width asked for, relative to the ratio


def rounds_needed(rounds: int, half_width: float, resolution: float = RESOLUTION) -> int:
    """Rounds that narrow an interval of ``half_width`` over ``rounds`` rounds to ``resolution``."""
    return math.ceil(rounds * (half_width / resolution) ** 2)


def analyse(path: str) -> dict[str, Any]:
    with open(path) as f:
        results = json.load(f)
    block = results["config"]["block"]
    models = {}
    for name, model in results["models"].items():
        ratio = ratio_interval(model["torch_ms"], model["ours_ms"], block)
        models[name] = {
            "ratio": asdict(ratio),
            "half_width": ratio.half_width,
            "rounds_for_2_percent": rounds_needed(ratio.rounds, ratio.half_width),
            "torch_step_ms": sorted(model["torch_ms"])[len(model["torch_ms"]) // 2],
        }
    return {"file": os.path.basename(path), "environment": results["environment"], "models": models}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", help="bench_engine.py --json files")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    runs = [analyse(path) for path in args.files]
    rows = [
        [run["file"], name, f"{run['environment']['loadavg'][0]:.1f}", m["ratio"]["rounds"],
         f"{m['ratio']['median']:.3f} ({m['ratio']['low']:.3f}-{m['ratio']['high']:.3f})",
         f"{100 * m['half_width']:.1f}", m["rounds_for_2_percent"]]
        for run in runs for name, m in run["models"].items()
    ]  # fmt: skip
    print(format_table(["file", "model", "load", "rounds", "ratio (95 %)", "+- %", "rounds for +-2 %"], rows))
    # keyed by the file name without ".json", so that a docs marker can name an entry by a dotted key
    results = {
        "environment": environment_info(),
        "runs": {os.path.splitext(run["file"])[0]: run for run in runs},
    }
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
