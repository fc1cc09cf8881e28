"""One rank of the benchmark: every contender's copy of the model, timed interleaved in this process.

Started by :mod:`lightning_ddpx.bench.launch` as ``python -m lightning_ddpx.bench.worker CONFIG RANK``
with the rendezvous in the environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``); writes its
results as JSON next to the config. Rank 0 prints progress.
"""

from __future__ import annotations

import gc
import json
import sys
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_ddpx.bench.contenders import contenders_named, gradient_bytes, is_ours, wrap
from lightning_ddpx.bench.launch import write_result
from lightning_ddpx.bench.timing import interleaved_timing
from lightning_ddpx.bench.workload import load_workload
from lightning_ddpx.engine.exit_threads import wait_for_idle_gloo_workers


def run(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    contenders = contenders_named(config["contenders"])
    shape = tuple(config["input_shape"]) if config["input_shape"] else None
    wrapped, workloads = {}, {}
    for contender in contenders:  # the same order on every rank: construction broadcasts parameters
        workload = load_workload(config["model"], shape, config["seed"], rank)
        wrapped[contender.name], _ = wrap(contender, workload.module, config["bucket_cap_mb"])
        workloads[contender.name] = workload
    steps = {name: _train_step(model, workloads[name]) for name, model in wrapped.items()}
    sent: dict[str, list[float]] = {name: [] for name in wrapped}
    exposed: dict[str, list[float]] = {name: [] for name in wrapped}
    after_step = {name: _stats_recorder(model, sent[name], exposed[name]) for name, model in wrapped.items()}

    def progress(r: int, rounds: int, times: dict[str, list[float]]) -> None:
        if rank == 0:
            parts = " | ".join(f"{name} {1e3 * sum(t) / len(t):.0f}" for name, t in times.items())
            print(f"  round {r + 1}/{rounds}: {parts} ms", flush=True)

    if rank == 0:
        print(f"  warming up {len(wrapped)} contenders ({config['warmup']} steps each) ...", flush=True)
    gc.collect()
    times = interleaved_timing(
        steps, config["steps"], config["warmup"], config["block"], on_block=progress, after_step=after_step
    )
    first = next(iter(workloads.values())).module
    result = {
        "rank": rank,
        "times_s": times,
        "bytes_sent": sent,
        "exposed_comm_s": exposed,
        "gradient_bytes": gradient_bytes(first),
        "param_tensors": sum(1 for _ in first.parameters()),
        "param_numel": sum(p.numel() for p in first.parameters()),
        "buckets": {name: len(m.bucket_plan()) if is_ours(m) else None for name, m in wrapped.items()},
    }
    for model in wrapped.values():
        if is_ours(model):
            model.close()
    return result


def _train_step(model: torch.nn.Module, workload: Any) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad()
        workload.loss(model).backward()
        optimizer.step()

    return step


def _stats_recorder(model: torch.nn.Module, sent: list[float], exposed: list[float]) -> Callable[[], None]:
    if not is_ours(model):  # torch's DDP allreduces every gradient and reports no exposed time
        return lambda: None

    def record() -> None:
        stats = model.comm_stats()
        sent.append(float("nan") if stats.bytes_sent is None else float(stats.bytes_sent))
        exposed.append(stats.exposed_comm_s)

    return record


def main(argv: list[str]) -> None:
    config_path, rank = argv[0], int(argv[1])
    with open(config_path) as f:
        config = json.load(f)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # subnormal gradients would time the FPU, not communication
    world_size = config["world_size"]
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=config["pg_timeout_s"])
    )
    try:
        result = run(rank, world_size, config)
    finally:
        dist.destroy_process_group()
        # torch's DDP contender may still reference the group, keeping gloo's workers alive past the destroy
        wait_for_idle_gloo_workers()
    write_result(config_path, rank, result)


if __name__ == "__main__":
    main(sys.argv[1:])
