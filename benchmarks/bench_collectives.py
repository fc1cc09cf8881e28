"""Ways to sum one gradient buffer across two gloo ranks, side by side (docs/benchmarks.md).

    python benchmarks/bench_collectives.py                        # 1, 7.2 and 16.8 MB over loopback
    python benchmarks/bench_collectives.py --sizes-mb 1 --repeats 40
    python benchmarks/bench_collectives.py --link 1gbit           # over the emulated 1 Gbit/s link (root)

Why: on this project's CPU machine communication is over a third of a small-tensor model's step, so the
first question for a faster step is whether the default reduction (one ``all_reduce`` per bucket, what
torch's DDP does) is the cheapest way to move the bytes. Contenders, on the same buffer, each after a
barrier, rounds rotated:

- ``whole``: one ``all_reduce``;
- ``N pieces``: ``N`` ``all_reduce`` calls on consecutive slices, issued together, waited in order;
- ``rs+ag``: ``reduce_scatter_tensor`` then ``all_gather_into_tensor``;
- ``halves``: each rank sends the other the half it does not own (``isend``/``irecv``), sums its own half,
  then the halves are exchanged back: a ring all-reduce for two ranks, written with point-to-point calls;
- ``shared memory``: the engine's own path for two ranks on one machine
  (:mod:`lightning_ddpx.engine.transport.shared_memory`): each rank copies into its slot of a shared file, a
  one-element all-reduce says both are written, each adds the other's slot. Absent over ``--link``, which
  stands for two machines.

Every contender's result is checked equal to ``a + b`` (two ranks: the sum is exact in either order).
Printed: median milliseconds and the ratio to ``whole`` per buffer size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import format_table, launch  # noqa: E402
from lightning_ddpx.bench.timing import rotated  # noqa: E402
from lightning_ddpx.engine.buckets.grad_bucket import GradBucket  # noqa: E402
from lightning_ddpx.engine.transport.shared_memory import (  # noqa: E402
    SharedMemoryExchange,
    gather_obstacles,
    local_obstacles,
    obstacles_refusal,
    open_exchange,
)

PIECE_COUNTS = (2, 4, 8)


def _whole(buffer: torch.Tensor) -> None:
    dist.all_reduce(buffer)


def _in_pieces(count: int) -> Callable[[torch.Tensor], None]:
    def reduce(buffer: torch.Tensor) -> None:
        works = [dist.all_reduce(piece, async_op=True) for piece in buffer.tensor_split(count)]
        for work in works:
            work.wait()

    return reduce


def _reduce_scatter_all_gather(buffer: torch.Tensor) -> None:
    mine = torch.empty(buffer.numel() // 2, dtype=buffer.dtype)
    dist.reduce_scatter_tensor(mine, buffer)
    dist.all_gather_into_tensor(buffer, mine)


def _halves(buffer: torch.Tensor) -> None:
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    halves = buffer.tensor_split(2)
    mine, theirs = halves[rank], halves[peer]
    received = torch.empty_like(mine)
    for work in (dist.isend(theirs, peer), dist.irecv(received, peer)):
        work.wait()
    mine.add_(received)
    for work in (dist.isend(mine, peer), dist.irecv(theirs, peer)):
        work.wait()


def _through(exchange: SharedMemoryExchange) -> Callable[[torch.Tensor], None]:
    def reduce(buffer: torch.Tensor) -> None:
        exchange.set_layout([buffer.numel() * buffer.element_size()])
        exchange.next_generation()  # what the reducer does as each backward starts
        exchange.sum_hook(dist.group.WORLD, GradBucket(0, buffer, [buffer], [], True)).wait()

    return reduce


def contenders(exchange: SharedMemoryExchange | None = None) -> dict[str, Callable[[torch.Tensor], None]]:
    """Name -> function summing a buffer in place across the two ranks (``shared memory`` with an exchange)."""
    return {
        "whole": _whole,
        **{f"{n} pieces": _in_pieces(n) for n in PIECE_COUNTS},
        "rs+ag": _reduce_scatter_all_gather,
        "halves": _halves,
        **({"shared memory": _through(exchange)} if exchange is not None else {}),
    }


def collective_rank(rank: int, world_size: int, sizes_mb: list[float], repeats: int) -> dict[str, Any]:
    """One rank: median milliseconds per contender and size; raises if a contender's sum is wrong."""
    if world_size != 2:
        raise ValueError(f"bench_collectives compares two-rank reductions; got world size {world_size}")
    numels = [2 * max(1, int(size_mb * 1e6 / 4) // 2) for size_mb in sizes_mb]  # even: the halves are equal
    # None over --link (DDPX_SHARED_MEMORY=0 there: the nodes stand for two machines)
    wanted = obstacles_refusal(gather_obstacles(dist.group.WORLD, local_obstacles(True)), rank) is None
    cases = contenders(open_exchange(dist.group.WORLD, [4 * max(numels)])[0] if wanted else None)
    out: dict[str, Any] = {}
    for size_mb, numel in zip(sizes_mb, numels):
        local = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        other = torch.randn(numel, generator=torch.Generator().manual_seed(1 - rank))
        expected = local + other
        times: dict[str, list[float]] = {name: [] for name in cases}
        for name, reduce in cases.items():  # correctness first, once each
            buffer = local.clone()
            reduce(buffer)
            if not torch.equal(buffer, expected):
                raise AssertionError(f"{name} did not sum the buffer ({size_mb} MB)")
        buffer = local.clone()
        for r in range(repeats):
            for name in rotated(tuple(cases), r):
                dist.barrier()
                started = time.perf_counter()
                cases[name](buffer)
                times[name].append(time.perf_counter() - started)
        out[f"{numel * 4 / 1e6:.1f} MB"] = {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 7.2, 16.8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--link", default=None, help="tc rate of an emulated link, e.g. 1gbit (root)")
    args = parser.parse_args(argv)
    results = launch(collective_rank, (args.sizes_mb, args.repeats), link=args.link)[0]
    names = list(next(iter(results.values())))
    print(f"2-rank gloo sum of one float32 buffer over {args.link or 'loopback'}: median ms (ratio to whole)")
    rows = [
        [size, *(f"{ms[name]:.2f} ({ms[name] / ms['whole']:.2f})" for name in names)]
        for size, ms in results.items()
    ]
    print(format_table(["buffer", *names], rows))
    return results


if __name__ == "__main__":
    main()
