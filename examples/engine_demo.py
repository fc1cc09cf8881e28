"""Train an MLP on scikit-learn's handwritten digits with 2 CPU processes and lightning_ddpx's module.

    python examples/engine_demo.py               # lightning_ddpx.DistributedDataParallel
    python examples/engine_demo.py --reference   # torch.nn.parallel.DistributedDataParallel, to compare

Each process trains on its own shard of the training set; the module averages gradients across processes,
so every rank keeps identical parameters, which the script checks at the end. The ranks deliberately start
from different random weights: the module's broadcast from rank 0 at construction has to align them.

Self-contained on purpose (no Lightning): torch.distributed over gloo on 127.0.0.1, one process per rank.
The data set ships inside scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


@dataclass(frozen=True)
class Digits:
    """The 8x8 digits, split into a training and a held-out part; pixels scaled to [0, 1]."""

    x_train: torch.Tensor  # (n_train, 64) float32
    y_train: torch.Tensor  # (n_train,) int64, classes 0-9
    x_test: torch.Tensor  # (n_test, 64) float32
    y_test: torch.Tensor  # (n_test,) int64


@dataclass(frozen=True)
class Config:
    """What one training run does; the same on every rank."""

    reference: bool = False  # wrap with torch's DistributedDataParallel instead of ours
    epochs: int = 3
    batch_size: int = 32  # per rank
    lr: float = 3e-3  # Adam
    seed: int = 0


def load_digits_split(test_fraction: float = 0.25, seed: int = 0) -> Digits:
    """scikit-learn's digits (1797 images of 64 pixels), split with every class in both parts."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )

    def features(a):
        return torch.as_tensor(a, dtype=torch.float32) / 16.0  # pixel values are 0..16

    def labels(a):
        return torch.as_tensor(a, dtype=torch.int64)

    return Digits(features(x_train), labels(y_train), features(x_test), labels(y_test))


def shard_indices(
    num_samples: int, rank: int, world_size: int, epoch: int = 0, seed: int = 0
) -> torch.Tensor:
    """This rank's sample indices for one epoch.

    Every rank draws the same permutation (from ``seed`` and ``epoch``) and takes every ``world_size``-th
    entry starting at ``rank``: the shards are disjoint, together cover every sample once, and their sizes
    differ by at most one.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}; pass 0 <= rank < world_size")
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator)[rank::world_size]


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    """Optimizer steps per epoch, equal on every rank (the largest shard decides): DDP needs equal counts."""
    return math.ceil(math.ceil(num_samples / world_size) / batch_size)


def split_batches(indices: torch.Tensor, num_steps: int) -> tuple[torch.Tensor, ...]:
    """``indices`` cut into ``num_steps`` consecutive batches whose sizes differ by at most one."""
    if len(indices) < num_steps:
        raise ValueError(
            f"a shard of {len(indices)} samples cannot fill {num_steps} steps; use a larger --batch-size"
        )
    return torch.tensor_split(indices, num_steps)


def make_model(hidden: int = 128) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )


def wrap(model: nn.Module, reference: bool) -> nn.Module:
    if reference:
        return torch.nn.parallel.DistributedDataParallel(model)
    from lightning_ddpx import DistributedDataParallel

    return DistributedDataParallel(model)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(rank: int, world_size: int, port: int, data: Digits, config: Config) -> None:
    """One rank's work: join the group, train, report (rank 0 prints), check parameters agree."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        _train(rank, world_size, data, config)
    finally:
        dist.destroy_process_group()


def _train(rank: int, world_size: int, data: Digits, config: Config) -> None:
    # A different start on each rank: the module's construction must broadcast rank 0's parameters.
    torch.manual_seed(config.seed + rank)
    model = wrap(make_model(), config.reference)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    loss_fn = nn.CrossEntropyLoss()
    num_steps = steps_per_epoch(len(data.y_train), world_size, config.batch_size)
    x_test, y_test = data.x_test[rank::world_size], data.y_test[rank::world_size]
    if rank == 0:
        engine = "torch.nn.parallel" if config.reference else "lightning_ddpx"
        print(
            f"{engine}.DistributedDataParallel on {world_size} processes (gloo, CPU): "
            f"{len(data.y_train)} training / {len(data.y_test)} held-out digits, "
            f"{num_steps} steps per epoch of {config.batch_size} per rank",
            flush=True,
        )
        if not config.reference:
            sizes = ", ".join(f"{info.num_bytes / 1024:.1f} KiB" for info in model.bucket_plan())
            print(f"gradient buckets: {sizes}", flush=True)

    for epoch in range(config.epochs):
        model.train()
        shard = shard_indices(len(data.y_train), rank, world_size, epoch, config.seed)
        loss_sum = step_seconds = 0.0
        for batch in split_batches(shard, num_steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(data.x_train[batch]), data.y_train[batch])
            loss.backward()
            optimizer.step()
            step_seconds += time.perf_counter() - start
            loss_sum += loss.item() * len(batch)

        model.eval()
        with torch.no_grad():  # evaluation needs no gradient sync: use the wrapped module directly
            correct = (model.module(x_test).argmax(dim=1) == y_test).sum().item()
        # One collective per epoch for every figure: summed losses, samples, correct, step time, steps.
        totals = torch.tensor([loss_sum, len(shard), correct, step_seconds, num_steps], dtype=torch.float64)
        dist.all_reduce(totals)
        if rank == 0:
            loss_total, samples, correct_total, seconds, steps = totals.tolist()
            print(
                f"epoch {epoch + 1}/{config.epochs}  train loss {loss_total / samples:.4f}  "
                f"held-out accuracy {100 * correct_total / len(data.y_test):.1f}%  "
                f"mean step {1000 * seconds / steps:.2f} ms",
                flush=True,
            )

    local = flat_parameters(model)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    identical = all(torch.equal(other, gathered[0]) for other in gathered)
    max_diff = max((other - gathered[0]).abs().max().item() for other in gathered)
    if rank == 0:
        print(
            f"parameters identical on all {world_size} ranks: {identical} "
            f"({local.numel()} values, max abs difference {max_diff:.3g})",
            flush=True,
        )
    if not identical:
        raise RuntimeError(
            f"rank {rank}: parameters differ across ranks after training (max abs difference "
            f"{max_diff:.3g}): gradients were not averaged identically on every rank"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reference",
        action="store_true",
        help="use torch.nn.parallel.DistributedDataParallel instead of lightning_ddpx's module",
    )
    parser.add_argument("--world-size", type=int, default=2, help="number of processes (default 2)")
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    parser.add_argument("--batch-size", type=int, default=Config.batch_size, help="per rank")
    parser.add_argument("--lr", type=float, default=Config.lr)
    parser.add_argument("--seed", type=int, default=Config.seed)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.reference:
        try:
            from lightning_ddpx import DistributedDataParallel  # noqa: F401
        except ImportError as error:
            print(
                f"lightning_ddpx.DistributedDataParallel cannot be imported ({error}).\n"
                "Install the package (bash scripts/demo.sh does), or pass --reference to run the same "
                "demo on torch's DistributedDataParallel.",
                file=sys.stderr,
            )
            return 2
    config = Config(args.reference, args.epochs, args.batch_size, args.lr, args.seed)
    data = load_digits_split(seed=args.seed)
    # Children inherit the environment: one OpenMP thread each, gloo on loopback (Linux names it "lo").
    os.environ["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start = time.perf_counter()
    # Spawn (not fork): fresh interpreters. A rank that raises stops the others and re-raises here.
    mp.spawn(train, args=(args.world_size, free_port(), data, config), nprocs=args.world_size, join=True)
    print(f"done in {time.perf_counter() - start:.1f} s (including process start-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
