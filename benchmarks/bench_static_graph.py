"""What ``static_graph=True`` saves per step on a model with unused parameters.

    python benchmarks/bench_static_graph.py                 # 2 CPU processes, gloo, ~1 minute
    python benchmarks/bench_static_graph.py --layers 300 --steps 120 --json static.json

The model: ``--layers`` residual ``Linear(64, 64)`` layers (``x + tanh(linear(x))``, batch 16) and an auxiliary
head that forward never uses, so the module needs ``find_unused_parameters=True`` -- and, without a static
graph, walks the autograd graph from forward's outputs in every step to find that head. Contenders, each its
own copy of the model in the same two processes, timed interleaved (``lightning_ddpx.bench.timing``):

- ``ours-dynamic``: ``lightning_ddpx.DistributedDataParallel(find_unused_parameters=True)``;
- ``ours-static``: the same with ``static_graph=True`` (the first step records, no walk afterwards);
- ``torch-dynamic`` / ``torch-static``: torch's DDP with the same arguments, for context.

The headline is the ratio static/dynamic of our module (median of same-round pair ratios) and the saving
in milliseconds per step; ``walk_ms`` is the graph walk timed alone on the same outputs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict
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
    summarize_pair,
)

WIDTH, BATCH = 64, 16


class ResidualWithUnusedHead(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.aux_head = nn.Linear(WIDTH, WIDTH)  # never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def run_rank(rank: int, world_size: int, layers: int, steps: int, warmup: int, block: int) -> dict[str, Any]:
    from lightning_ddpx import DistributedDataParallel
    from lightning_ddpx.engine.reducer.reachability import reachable_parameter_indices

    torch.set_flush_denormal(True)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(BATCH, WIDTH, generator=generator)
    target = torch.randn(BATCH, WIDTH, generator=generator)
    models = {}
    for name in ("ours-dynamic", "ours-static", "torch-dynamic", "torch-static"):
        torch.manual_seed(0)
        module = ResidualWithUnusedHead(layers)
        kwargs = {"find_unused_parameters": True, "static_graph": name.endswith("static")}
        wrapper = DistributedDataParallel if name.startswith("ours") else nn.parallel.DistributedDataParallel
        models[name] = wrapper(module, **kwargs)

    steps_of = {
        name: make_train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), (inputs, target))
        for name, model in models.items()
    }
    gc.collect()
    times = interleaved_timing(steps_of, steps, warmup, block)

    # The walk alone, on outputs of the same model, as the dynamic path does it once per step.
    ours = models["ours-dynamic"]
    index_of = ours.reducer.index_of
    output = ours.module(inputs)
    walks = []
    for _ in range(20):
        started = time.perf_counter()
        reachable_parameter_indices(output, index_of)
        walks.append(time.perf_counter() - started)
    walks.sort()
    for name in ("ours-dynamic", "ours-static"):
        models[name].close()
    return {"times_s": times, "walk_ms": 1e3 * walks[len(walks) // 2]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=150)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    print(
        f"{args.layers} residual Linear({WIDTH}, {WIDTH}) + unused head, batch {BATCH}, 2 processes",
        flush=True,
    )
    rank0 = launch(run_rank, (args.layers, args.steps, args.warmup, args.block), world_size=2)[0]
    times = rank0["times_s"]
    ours = summarize_pair(times["ours-dynamic"], times["ours-static"])
    theirs = summarize_pair(times["torch-dynamic"], times["torch-static"])
    rows = [
        ["ours", f"{ours.baseline_ms:.2f}", f"{ours.candidate_ms:.2f}", f"{ours.ratio:.3f}",
         f"{ours.ratio_p25:.3f}-{ours.ratio_p75:.3f}", f"{ours.baseline_ms - ours.candidate_ms:.2f}"],
        ["torch", f"{theirs.baseline_ms:.2f}", f"{theirs.candidate_ms:.2f}", f"{theirs.ratio:.3f}",
         f"{theirs.ratio_p25:.3f}-{theirs.ratio_p75:.3f}", f"{theirs.baseline_ms - theirs.candidate_ms:.2f}"],
    ]  # fmt: skip
    header = ["module", "dynamic ms", "static ms", "static/dynamic", "p25-p75", "saved ms/step"]
    print(format_table(header, rows))
    print(f"graph walk alone (ours, median of 20): {rank0['walk_ms']:.2f} ms")
    results = {
        "environment": environment_info(),
        "config": vars(args),
        "ours": asdict(ours),
        "torch": asdict(theirs),
        "walk_ms": rank0["walk_ms"],
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
