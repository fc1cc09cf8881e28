"""Where a data-parallel step's extra time goes, per phase, ours vs torch's DDP, in one process (gloo, world size 1).

    python benchmarks/bench_step_phases.py                        # model "many" (300 tensors)
    python benchmarks/bench_step_phases.py --models many tiny300  # and 150 Linear(4, 4): per-tensor work only
    python benchmarks/bench_step_phases.py --without scale        # ours with a part of its work left out

Three contenders (the plain model, torch's DDP, ours) step in the same process, interleaved in short blocks
(rotating which goes first), each phase of each step -- ``zero_grad``, forward, backward (which synchronises),
optimizer step -- timed in thread CPU time. Printed: each wrapper's extra time over the plain model's, per
phase (median of same-round differences), in microseconds. With one rank nothing is waited for, so what is
left is what data parallelism costs per step: hooks, copies into and out of the buckets, bookkeeping.

``--without`` leaves a part of our backward out, to see what it costs (timing only: the gradients are then
wrong): ``scale`` (the division by the world size, done as its own pass over each bucket for buckets of many
small tensors), ``fill`` (the copy of the gradients into the buckets, and the scale), ``write-back`` (the copy
of the averaged buckets into ``.grad``). docs/benchmarks.md ("Where the 300-tensor model's time goes") has
figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import free_port  # noqa: E402
from lightning_ddpx import DistributedDataParallel  # noqa: E402
from lightning_ddpx.bench.models import MODELS, build_model  # noqa: E402
from lightning_ddpx.bench.timing import rotated  # noqa: E402
from lightning_ddpx.engine.buckets import storage as buckets  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step")
CONTENDERS = ("plain", "torch", "ours")


def leave_out(parts: list[str]) -> None:
    """Replace parts of our bucket work with nothing (timing only)."""
    Bucket, fill = buckets.Bucket, buckets.Bucket.fill

    def fill_unscaled(self: Any, scale: float | None, all_used: bool, target: Any = None) -> None:
        fill(self, None, all_used, target)

    if "fill" in parts:
        Bucket.fill = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    elif "scale" in parts:
        Bucket.fill = fill_unscaled  # type: ignore[method-assign]
    if "write-back" in parts:
        Bucket.write_back = lambda self, *args, **kwargs: None  # type: ignore[method-assign]


def build(name: str) -> tuple[Callable[[], nn.Module], tuple[torch.Tensor, torch.Tensor]]:
    if name == "tiny300":  # 300 parameter tensors of 4-16 elements: per-tensor work without data
        inputs, target = torch.randn(2, 4), torch.randn(2, 4)
        return (lambda: nn.Sequential(*[nn.Linear(4, 4) for _ in range(150)])), (inputs, target)
    spec = MODELS[name]
    return (lambda: build_model(name)), (torch.randn(spec.input_shape), torch.randn(spec.target_shape))


def phase_times(name: str, rounds: int, block: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    make, (inputs, target) = build(name)
    models: dict[str, Any] = {}
    wrappers = {"plain": None, "torch": nn.parallel.DistributedDataParallel, "ours": DistributedDataParallel}
    for key, wrap in wrappers.items():
        torch.manual_seed(0)
        models[key] = make() if wrap is None else wrap(make())
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    times: dict[str, dict[str, list[float]]] = {k: {p: [] for p in PHASES} for k in CONTENDERS}

    def step(key: str, record: bool) -> None:
        model, optimizer = models[key], optimizers[key]
        t0 = time.thread_time()
        optimizer.zero_grad()
        t1 = time.thread_time()
        loss = nn.functional.mse_loss(model(inputs), target)
        t2 = time.thread_time()
        loss.backward()
        t3 = time.thread_time()
        optimizer.step()
        t4 = time.thread_time()
        if record:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[key][phase].append(seconds)

    for _ in range(5):  # warm-up: bucket rebuilds, allocator
        for key in CONTENDERS:
            step(key, False)
    for r in range(rounds):
        for key in rotated(CONTENDERS, r):
            for _ in range(block):
                step(key, True)
    return {
        key: {
            phase: 1e6 * statistics.median(a - b for a, b in zip(times[key][phase], times["plain"][phase]))
            for phase in PHASES
        }
        for key in ("torch", "ours")
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["many"], choices=sorted(MODELS) + ["tiny300"])
    parser.add_argument("--without", nargs="*", default=[], choices=("scale", "fill", "write-back"))
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--block", type=int, default=5)
    args = parser.parse_args(argv)
    leave_out(args.without)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        left_out = f" (ours without: {', '.join(args.without)})" if args.without else ""
        print(f"extra thread CPU time over the plain model, us per step{left_out}")
        print(f"{'model':10s} {'wrapper':8s} " + " ".join(f"{p:>10s}" for p in PHASES) + f" {'total':>10s}")
        for name in args.models:
            for key, phases in phase_times(name, args.rounds, args.block).items():
                cells = " ".join(f"{phases[p]:10.0f}" for p in PHASES)
                print(f"{name:10s} {key:8s} {cells} {sum(phases.values()):10.0f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
