"""Per-parameter cost of data parallelism, ours vs torch's DDP, in one process (gloo, world size 1).

    python benchmarks/bench_per_parameter.py                                 # many, many1000
    python benchmarks/bench_per_parameter.py --models many1000 --gradient-as-bucket-view --rounds 60
    python benchmarks/bench_per_parameter.py --before /tmp/before   # + the package at an earlier commit
    python benchmarks/bench_per_parameter.py --hook-floor           # + the plain model with no-op hooks

With one rank there is no communication to wait for, so what is left over a plain model's step is what data
parallelism costs per step: hooks, bucket copies, bookkeeping. Three contenders (plain model, torch's DDP,
ours) step in the same process, interleaved in short blocks, and each step is timed in *thread CPU time*,
which other jobs on a shared machine do not inflate (wall time would). Printed per model: each wrapper's
overhead over the plain step in microseconds per parameter tensor (median of same-round differences, with
p25-p75), and the ratio ours/torch of whole steps. docs/benchmarks.md ("Per-parameter cost") has figures.

``--hook-floor`` adds the plain model twice more, once with a Python hook that does nothing on each
parameter's gradient accumulator (the hook our reducer is told a gradient is ready by, see
``lightning_ddpx.engine.reducer.accumulator_hooks``) and once with a no-op ``register_post_accumulate_grad_hook``
instead: what any reducer written in Python pays per gradient before doing anything, where torch's reducer
is called from C++.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import free_port, make_train_step  # noqa: E402
from lightning_ddpx import DistributedDataParallel  # noqa: E402
from lightning_ddpx.bench.models import MODELS, build_model  # noqa: E402
from lightning_ddpx.bench.timing import rotated  # noqa: E402
from lightning_ddpx.engine.reducer.accumulator_hooks import gradient_accumulator  # noqa: E402

CONTENDERS = ("plain", "torch", "ours")
HOOK_FLOOR = ("accumulator-hook", "tensor-hook")


def _ignore(*_args: Any) -> None:
    pass


def with_noop_hooks(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """``model`` with a no-op Python hook on each parameter's gradient: on its accumulator node (held by the
    model, as a reducer holds them, so every backward uses it) or a post-accumulate-grad hook."""
    if kind == "accumulator-hook":
        accumulators = [gradient_accumulator(p) for p in model.parameters()]
        for node in accumulators:
            node.register_hook(_ignore)
        model._held_accumulators = accumulators  # type: ignore[assignment]
    else:
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(_ignore)
    return model


def measure(
    name: str, bucket_view: bool, rounds: int, block: int, before: Any = None, hook_floor: bool = False
) -> dict[str, float]:
    """Thread-CPU step times of the contenders on model ``name``; overheads and the step ratio. ``before``:
    a fourth contender's class (benchmarks/snapshot_package.py's ``DistributedDataParallel``);
    ``hook_floor``: the plain model with no-op gradient hooks, of both kinds, as two more."""
    contenders = CONTENDERS + (("before",) if before is not None else ()) + (HOOK_FLOOR if hook_floor else ())
    spec = MODELS[name]
    torch.manual_seed(0)
    x, y = torch.randn(spec.input_shape), torch.randn(spec.target_shape)
    models = {
        "plain": build_model(name),
        "torch": torch.nn.parallel.DistributedDataParallel(
            build_model(name), gradient_as_bucket_view=bucket_view
        ),
        "ours": DistributedDataParallel(build_model(name), gradient_as_bucket_view=bucket_view),
    }
    if before is not None:
        models["before"] = before(build_model(name), gradient_as_bucket_view=bucket_view)
    if hook_floor:
        models.update({kind: with_noop_hooks(build_model(name), kind) for kind in HOOK_FLOOR})
    steps = {
        k: make_train_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), (x, y)) for k, m in models.items()
    }
    for _ in range(5):  # warm-up: bucket rebuild, allocator
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(rounds):
        for k in rotated(contenders, r):  # each contender in each position equally often
            for _ in range(block):
                started = time.thread_time()
                steps[k]()
                times[k].append(time.thread_time() - started)
    tensors = len(list(models["plain"].parameters()))
    result: dict[str, float] = {"tensors": tensors}
    for k in contenders[1:]:
        overhead = [t - p for t, p in zip(times[k], times["plain"])]
        q = statistics.quantiles(overhead, n=4)
        result[f"{k}_us_per_param"] = 1e6 * statistics.median(overhead) / tensors
        result[f"{k}_us_p25"], result[f"{k}_us_p75"] = 1e6 * q[0] / tensors, 1e6 * q[2] / tensors
    ratios = [o / t for o, t in zip(times["ours"], times["torch"])]
    q = statistics.quantiles(ratios, n=4)
    result.update(ratio=statistics.median(ratios), ratio_p25=q[0], ratio_p75=q[2])
    if before is not None:
        result["ours_vs_before"] = statistics.median(o / b for o, b in zip(times["ours"], times["before"]))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["many", "many1000"], choices=sorted(MODELS))
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=40, help="interleaved rounds (each contender once a round)"
    )
    parser.add_argument("--block", type=int, default=5, help="steps per contender per round")
    parser.add_argument("--before", metavar="DIR", help="add lightning_ddpx_before from DIR as a contender")
    parser.add_argument(
        "--hook-floor", action="store_true", help="add the plain model with no-op gradient hooks (two kinds)"
    )
    args = parser.parse_args(argv)
    before = None
    if args.before:
        from benchmarks.snapshot_package import snapshot_module_class

        before = snapshot_module_class(args.before)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        print(f"gradient_as_bucket_view={args.gradient_as_bucket_view}; thread CPU time, one process")
        print(
            "model      tensors  torch us/param (p25-p75)  ours us/param (p25-p75)  ours/torch step (p25-p75)"
        )
        for name in args.models:
            r = measure(name, args.gradient_as_bucket_view, args.rounds, args.block, before, args.hook_floor)
            print(
                f"{name:10s} {r['tensors']:7d}  {r['torch_us_per_param']:6.2f} ({r['torch_us_p25']:.2f}-"
                f"{r['torch_us_p75']:.2f})      {r['ours_us_per_param']:6.2f} ({r['ours_us_p25']:.2f}-"
                f"{r['ours_us_p75']:.2f})     {r['ratio']:.3f} ({r['ratio_p25']:.3f}-{r['ratio_p75']:.3f})"
                + (
                    f"  before {r['before_us_per_param']:.2f} us/param, ours/before step {r['ours_vs_before']:.3f}"
                    if before is not None
                    else ""
                )
                + "".join(
                    f"  {kind} {r[f'{kind}_us_per_param']:.2f} ({r[f'{kind}_us_p25']:.2f}-{r[f'{kind}_us_p75']:.2f})"
                    for kind in (HOOK_FLOOR if args.hook_floor else ())
                )
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
