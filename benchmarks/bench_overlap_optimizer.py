"""Step time with the optimizer overlapped with communication (``overlap_optimizer_with``) against torch's DDP.

    python benchmarks/bench_overlap_optimizer.py                          # loopback, mlp/transformer/many
    python benchmarks/bench_overlap_optimizer.py --link 1gbit             # emulated 1 Gbit/s link (root)
    python benchmarks/bench_overlap_optimizer.py --models mlp --steps 20 --json out.json

Three contenders train their own copy of the same model in the same two processes, timed interleaved in
short blocks (``lightning_ddpx.bench.timing``: on a shared machine only ratios of steps measured close
together mean something):

- ``torch``: torch's DDP, then ``AdamW.step()`` after backward (the baseline);
- ``ours``: our module, the same plain ``AdamW.step()`` after backward;
- ``overlap``: our module with ``model.overlap_optimizer_with(adamw)``: each bucket's parameters step as
  soon as the bucket is reduced, while later buckets still communicate; no ``step()`` after backward. On
  the CPU its long parameters are updated slice by slice (``lightning_ddpx.engine.optim.piecewise_step``);
- ``overlap_whole`` (with ``--compare-unsliced``): the same, every parameter updated whole (an overlap built
  with ``slice_bytes=None``): what the slices gain, measured in the same run.

A step is zero_grad, forward, MSE loss, backward (and the step). Reported: the median and p25/p75 of
same-round ratios ours/torch and overlap/torch, the optimizer's share of a step (``AdamW.step()`` timed
alone), the update the overlap left exposed (write-back and update after the last reduction arrived,
median), and the largest parameter difference between overlap and torch after the run (same steps, same
data: it must be ~1e-6 or less). With ``--link`` each rank runs in its own network namespace joined by a
veth pair shaped with tc (``lightning_ddpx.bench.netns``; needs root). Run from the repository root.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    build_model,
    environment_info,
    format_table,
    interleaved_timing,
    make_batch,
    max_param_diff,
    parameter_summary,
    summarize_pair,
    verdict,
)

DEFAULT_MODELS = ("mlp", "transformer", "many")
CONTENDERS = ("torch", "ours", "overlap")
TARGET = {"mlp": 0.90}  # overlap/torch on the emulated 1 Gbit/s link (issue #13)
WORKER = "benchmarks.bench_overlap_optimizer"


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def run_rank(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """One rank: a wrapped copy of the model per contender, timed interleaved; then the optimizer alone."""
    from lightning_ddpx import DistributedDataParallel as OursDDP
    from lightning_ddpx.engine.optim.overlap import OptimizerOverlap

    inputs, target = make_batch(config["model"], rank, config["seed"])
    contenders = CONTENDERS + (("overlap_whole",) if config["compare_whole"] else ())
    wrapped = {"torch": nn.parallel.DistributedDataParallel(build_model(config["model"], config["seed"]))}
    for name in contenders[1:]:
        wrapped[name] = OursDDP(build_model(config["model"], config["seed"]))
    optimizers = {name: _adamw(model, config["lr"]) for name, model in wrapped.items()}
    for name in contenders[2:]:
        wrapped[name].overlap_optimizer_with(optimizers[name])
    if config["compare_whole"]:  # the alternative injected: an overlap that updates every parameter whole
        reducer = wrapped["overlap_whole"].reducer
        reducer.overlap.close()
        reducer.set_overlap(OptimizerOverlap(optimizers["overlap_whole"], reducer, slice_bytes=None))

    def make_step(name: str) -> Any:
        model, optimizer = wrapped[name], optimizers[name]
        plain = name in ("torch", "ours")

        def step() -> None:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), target).backward()
            if plain:
                optimizer.step()

        return step

    # per overlapped contender: (seconds of bucket steps inside backward, seconds exposed after the last
    # reduction arrived) of each timed step
    inside: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders[2:]}

    def record(name: str) -> Any:
        overlap = wrapped[name].reducer.overlap
        return lambda: inside[name].append((overlap.last_optimizer_s, overlap.last_exposed_update_s))

    gc.collect()
    times = interleaved_timing(
        {name: make_step(name) for name in contenders},
        config["steps"],
        config["warmup"],
        config["block"],
        after_step={name: record(name) for name in contenders[2:]},
    )
    diff = max_param_diff(wrapped["overlap"].module, wrapped["torch"].module)
    plain_diff = max_param_diff(wrapped["ours"].module, wrapped["torch"].module)
    # The optimizer alone (no communication): its share of a step bounds what overlapping can hide.
    optimizer_s = []
    for _ in range(5):
        started = time.perf_counter()
        optimizers["torch"].step()
        optimizer_s.append(time.perf_counter() - started)
    for name in contenders[1:]:
        wrapped[name].close()
    optimizer_s.sort()
    return {
        "times_s": times,
        "max_diff_overlap_vs_torch": diff,
        "max_diff_ours_vs_torch": plain_diff,
        "optimizer_alone_ms": 1e3 * optimizer_s[len(optimizer_s) // 2],
        "optimizer_inside_backward_ms": {
            name: 1e3 * _median([s for s, _ in v]) for name, v in inside.items()
        },
        "exposed_update_ms": {name: 1e3 * _median([s for _, s in v]) for name, v in inside.items()},
        "sliced_params": wrapped["overlap"].reducer.overlap.last_sliced_params,
        "buckets": len(wrapped["overlap"].bucket_plan()),
        "parameters": parameter_summary(wrapped["torch"].module),
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def worker_main(config_path: str, rank: int) -> None:
    """``python -m benchmarks.bench_overlap_optimizer CONFIG.json RANK``, started by ``run_ranks``."""
    with open(config_path) as f:
        config = json.load(f)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # subnormal values would time the FPU, not the data-parallel machinery
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    try:
        result = run_rank(rank, config)
    finally:
        dist.destroy_process_group()
    out = os.path.join(os.path.dirname(config_path), f"rank{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_ddpx.bench.launch import run_ranks

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--link", default=None, help="tc rate of an emulated link, e.g. 1gbit (root only)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--compare-unsliced", action="store_true",
        help="a fourth contender: the overlap with every parameter updated whole (no slices)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    link = args.link or "loopback"
    rows, results = [], {"environment": environment_info(), "config": vars(args), "models": {}}
    for name in args.models:
        config = {"world_size": 2, "model": name, "steps": args.steps, "warmup": args.warmup,
                  "block": args.block, "lr": args.lr, "seed": args.seed,
                  "compare_whole": args.compare_unsliced}  # fmt: skip
        print(f"{name} over {link}: {args.steps} timed steps per contender ...", flush=True)
        rank0 = run_ranks(config, args.link, args.timeout, worker=WORKER)[0]
        times = rank0["times_s"]
        plain = summarize_pair(times["torch"], times["ours"])
        overlap = summarize_pair(times["torch"], times["overlap"])
        share = rank0["optimizer_alone_ms"] / plain.baseline_ms
        exposed = rank0["exposed_update_ms"]
        whole = summarize_pair(times["torch"], times["overlap_whole"]) if "overlap_whole" in times else None
        if whole is not None:
            print(
                f"  overlap, every parameter whole: overlap_whole/torch {whole.ratio:.3f} "
                f"({whole.ratio_p25:.3f}-{whole.ratio_p75:.3f}), exposed update "
                f"{exposed['overlap_whole']:.1f} ms; {rank0['sliced_params']} parameter(s) in slices: "
                f"{overlap.ratio:.3f}, exposed {exposed['overlap']:.1f} ms",
                flush=True,
            )
        target = TARGET.get(name) if args.link else None
        rows.append([
            name, link, str(rank0["buckets"]), f"{plain.baseline_ms:.1f}", f"{plain.candidate_ms:.1f}",
            f"{overlap.candidate_ms:.1f}", f"{plain.ratio:.3f} ({plain.ratio_p25:.3f}-{plain.ratio_p75:.3f})",
            f"{overlap.ratio:.3f} ({overlap.ratio_p25:.3f}-{overlap.ratio_p75:.3f})",
            f"{rank0['optimizer_alone_ms']:.1f} ({100 * share:.0f}%)", f"{exposed['overlap']:.1f}",
            f"{rank0['max_diff_overlap_vs_torch']:.1e}",
            verdict(overlap.ratio, target),
        ])  # fmt: skip
        results["models"][name] = {
            "link": link,
            "ours_vs_torch": asdict(plain),
            "overlap_vs_torch": asdict(overlap),
            **({"overlap_whole_vs_torch": asdict(whole)} if whole is not None else {}),
            **{k: v for k, v in rank0.items() if k != "times_s"},
            "times_s": times,
        }
    header = ["model", "link", "buckets", "torch ms", "ours ms", "overlap ms", "ours/torch (p25-p75)",
              "overlap/torch (p25-p75)", "AdamW alone ms (share)", "exposed update ms", "max |diff|",
              "target"]  # fmt: skip
    print(format_table(header, rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1].endswith(".json"):  # a rank started by run_ranks
        worker_main(sys.argv[1], int(sys.argv[2]))
    else:
        main()
