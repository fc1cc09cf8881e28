"""Why PowerSGD rank 2 is no faster than rank 4 here: time each part of one compressed matrix per rank.

One process, one thread, the MLP benchmark's matrix shape (2048 x 2048, fp32): the two thin products
(P = X Q and Q = X^T P, as the hook computes them), orthogonalising P and Q (Gram-Schmidt for ranks 1-2,
Householder QR above, as :func:`lightning_ddpx.hooks.powersgd.lowrank.orthogonalize_` chooses), the low-rank
reconstruction P Q^T into the bucket, and the bytes P and Q put on the wire. Ranks are interleaved in
rounds and medians reported, so a loaded machine shifts all ranks alike.

    OMP_NUM_THREADS=1 python benchmarks/bench_powersgd_rank.py [--rows 2048 --cols 2048 --rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from lightning_ddpx.hooks.powersgd.lowrank import left_project_, orthogonalize_, reconstruct_, right_project_

RANKS = (1, 2, 4, 8)


def timed(fn: Callable[[], object], repeats: int = 3) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, m = args.rows, args.cols
    x = torch.randn(n, m)
    out = torch.empty(n, m)
    parts = ("X Q", "X^T P", "orth P", "orth Q", "P Q^T")
    samples: dict[tuple[int, str], list[float]] = {(r, p): [] for r in RANKS for p in parts}
    for _ in range(args.rounds):
        for r in RANKS:
            p, q = torch.randn(n, r), torch.randn(m, r)
            samples[(r, "X Q")].append(timed(lambda p=p, q=q: right_project_(p, x, q)))
            samples[(r, "X^T P")].append(timed(lambda p=p, q=q: left_project_(q, x, p)))
            samples[(r, "orth P")].append(timed(lambda p=p: orthogonalize_(p.unsqueeze(0))))
            samples[(r, "orth Q")].append(timed(lambda q=q: orthogonalize_(q.unsqueeze(0))))
            samples[(r, "P Q^T")].append(timed(lambda p=p, q=q: reconstruct_(out, p, q)))
    print(f"{n} x {m} fp32, 1 thread, medians of {args.rounds} interleaved rounds (ms per matrix)")
    print(f"{'rank':>4}  " + "  ".join(f"{p:>8}" for p in parts) + f"  {'total':>8}  {'P+Q KiB':>8}")
    for r in RANKS:
        medians = [statistics.median(samples[(r, p)]) for p in parts]
        wire = (n + m) * r * 4 / 1024
        print(f"{r:>4}  " + "  ".join(f"{v:8.2f}" for v in medians) + f"  {sum(medians):8.2f}  {wire:8.0f}")
    print(f"X itself: {n * m * 4 / 2**20:.0f} MiB, read once by each thin product whatever the rank")


if __name__ == "__main__":
    main()
