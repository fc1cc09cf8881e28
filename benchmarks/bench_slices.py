"""What the overlap's chunks and slices cost and gain, measured in isolation (docs/benchmarks.md).

    python benchmarks/bench_slices.py                     # both parts, chunks over loopback
    python benchmarks/bench_slices.py --link 1gbit        # chunks over the emulated 1 Gbit/s link (root)
    python benchmarks/bench_slices.py --part slices       # one process only

- ``slices``: one optimizer step on one 2048 x 2048 weight, whole and in slices of several sizes
  (``lightning_ddpx.engine.optim.piecewise_step``, the update the overlap applies to long parameters), for AdamW
  and SGD with momentum; one thread, median of ``--repeats``. The results are checked bit-identical.
- ``chunks``: a 2-rank gloo allreduce of one 16.8 MB buffer (the MLP's first-layer weight), whole and as
  4 ... 32 chunks issued at once, waited in order (what the overlap does with its last bucket); median of
  ``--repeats`` after a barrier each.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import format_table, launch  # noqa: E402
from lightning_ddpx.engine.buckets.plan import chunk_ranges  # noqa: E402
from lightning_ddpx.engine.optim.piecewise_step import PiecewiseStep, optimizer_view  # noqa: E402

SLICE_SIZES = (32768, 65536, 131072, 262144, 524288, 1048576)
CHUNK_COUNTS = (4, 8, 16, 32)
SHAPE = (2048, 2048)
OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    "SGD momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _step_in_slices(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, slice_numel: int) -> None:
    make_view = functools.partial(optimizer_view, optimizer)
    piecewise = PiecewiseStep(make_view, optimizer.param_groups[0], param, optimizer.state[param])
    for start, end in chunk_ranges([0], [param.numel()], slice_numel):
        piecewise.step(start, end)
    piecewise.finish()


def measure_slices(repeats: int) -> dict[str, dict[str, float]]:
    """Milliseconds per step by optimizer and slice size (``whole``: one step of the whole tensor)."""
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(SHAPE))
        param.grad = torch.randn(SHAPE)
        twin = copy.deepcopy(param)
        twin.grad = param.grad.clone()
        optimizer, twin_optimizer = make([param]), make([twin])
        optimizer.step()  # creates the state: slices need it
        twin_optimizer.step()
        row: dict[str, float] = {}
        for size in (0, *SLICE_SIZES):
            samples = []
            for _ in range(repeats):
                started = time.perf_counter()
                if size == 0:
                    optimizer.step()
                else:
                    _step_in_slices(optimizer, param, size)
                samples.append(time.perf_counter() - started)
                # the twin takes the same number of whole steps: the results must stay identical
                twin_optimizer.step()
            row["whole" if size == 0 else str(size)] = 1e3 * _median(samples)
        if not torch.equal(param, twin):
            raise AssertionError(f"{name}: the sliced updates differ from the whole ones")
        results[name] = row
    return results


def chunk_rank(rank: int, world_size: int, repeats: int) -> dict[str, float]:
    """One rank of the chunk measurement: milliseconds per allreduce, whole and by chunk count."""
    torch.set_num_threads(1)
    buffer = torch.randn(SHAPE[0] * SHAPE[1])

    def reduce_in(count: int) -> None:
        ranges = chunk_ranges([0], [buffer.numel()], buffer.numel() // count)
        futures = [dist.all_reduce(buffer[a:b], async_op=True).get_future() for a, b in ranges]
        for future in futures:
            future.wait()

    cases = {"whole": 1, **{f"{n} chunks": n for n in CHUNK_COUNTS}}
    for count in cases.values():
        reduce_in(count)  # warm-up: connections, allocations
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, count in cases.items():
            dist.barrier()
            started = time.perf_counter()
            reduce_in(count)
            samples[name].append(time.perf_counter() - started)
    return {name: 1e3 * _median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("slices", "chunks", "both"), default="both")
    parser.add_argument(
        "--link", default=None, help="tc rate of an emulated link for chunks, e.g. 1gbit (root)"
    )
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    if args.part in ("slices", "both"):
        out["slices"] = measure_slices(args.repeats)
        header = ["optimizer", "whole ms", *(f"{size // 1024}K ms" for size in SLICE_SIZES)]
        rows = [[name, *(f"{ms:.1f}" for ms in row.values())] for name, row in out["slices"].items()]
        print(f"One step on a {SHAPE[0]} x {SHAPE[1]} weight, whole and in slices (elements); bit-identical:")
        print(format_table(header, rows))
    if args.part in ("chunks", "both"):
        out["chunks"] = launch(chunk_rank, (args.repeats,), link=args.link)[0]
        print(f"2-rank gloo allreduce of 16.8 MB over {args.link or 'loopback'}, whole and in chunks:")
        print(format_table(list(out["chunks"]), [[f"{ms:.1f}" for ms in out["chunks"].values()]]))
    return out


if __name__ == "__main__":
    main()
