"""One process of the fault-quality benchmark: the convergence benchmark's digits task, bare-module fault tolerance.

    python -m lightning_ddpx.fault.launch --nproc 3 --replacements 1 -- \\
        benchmarks/fault_quality_job.py OUT_DIR --seed 0 --steps 120 [--kill 00001:48:backward]

The model, data split, optimizer and validation are the digits task's (:mod:`lightning_ddpx.bench.tasks`:
``DigitsCNN``, ``DigitsUpscaled``, ``configure_optimizers``, cross-entropy on the held-out quarter). The data
order is the job's, so that a step's samples do not depend on who is left to compute it: the global batch of
committed step ``s`` is slice ``s mod E`` of a permutation of the training set drawn from ``(seed, s // E)``
(``E`` batches per epoch, as a shuffling ``DataLoader`` with ``drop_last``), and rank ``r`` of ``w`` takes
every ``w``-th sample of it from the ``r``-th. Each rank's loss is its share's summed cross-entropy times
``w / global batch``, so the average over ranks is the global batch's mean loss whatever ``w`` is: a step
discarded with three ranks and retried by two computes the same gradient, up to rounding.

``--kill UID:STEP:POINT``: process ``UID`` kills itself with SIGKILL at attempt ``STEP`` (a committed-step
count), at ``backward`` (from the first convolution's gradient hook: the last gradient of backward, the dense
layers' buckets already in flight) or ``forward``. A replacement starts from other weights (seed + 1000), so
only healing can make it equal.

Writes ``OUT_DIR/<uid>.jsonl``: a ``step`` record per committed step (generation, world size), a ``val`` record
every ``--val-every`` committed steps from the generation's rank 0, and an ``end`` record from every process
that finished (final validation loss and accuracy, a digest of the parameters, the fault-tolerance stats).
``--degraded-pause-s``: the survivors sleep after each step while a rank is missing, so that in a short run the
replacement arrives before the end; it changes when steps run, not what they compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_ddpx.bench.tasks import DigitsCNN, DigitsUpscaled  # noqa: E402
from lightning_ddpx.fault import FaultTolerance, RunEnded  # noqa: E402

GLOBAL_BATCH = 48  # 3 x 16, the convergence benchmark's 16 images per rank; 2 survivors take 24 each
REPLACEMENT_SEED_OFFSET = 1000  # a replacement's own initial weights, overwritten when it is healed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument("--steps", type=int, default=120, help="committed steps to train")
    parser.add_argument("--val-every", type=int, default=20, help="validate every N committed steps (rank 0)")
    parser.add_argument("--kill", default="", help="UID:STEP:POINT, POINT one of backward, forward")
    parser.add_argument(
        "--degraded-pause-s", type=float, default=0.0, help="sleep after each step while a rank is missing"
    )
    return parser.parse_args(argv)


def global_batch_indices(seed: int, step: int, train_size: int) -> torch.Tensor:
    """The training-set indices of committed step ``step``'s global batch: a function of (seed, step) only."""
    per_epoch = train_size // GLOBAL_BATCH
    epoch, within = divmod(step, per_epoch)
    order = torch.randperm(train_size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[within * GLOBAL_BATCH : (within + 1) * GLOBAL_BATCH]


def validate(net: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """The digits task's ``val_loss`` and ``val_acc`` over the whole held-out set (mean cross-entropy)."""
    with torch.no_grad():
        logits = net(images).reshape(-1, net.num_classes)
    return nn.functional.cross_entropy(logits, labels).item(), (
        logits.argmax(-1) == labels
    ).float().mean().item()


def digest(net: nn.Module) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    kill_uid, kill_step, kill_point = (
        (args.kill.split(":") + ["", "", ""])[:3] if args.kill else ("", "-1", "")
    )
    try:
        # A short collective timeout: a survivor blocked on another survivor that left the failed step waits
        # this long (benchmarks/bench_fault_quality.py); a step or a heal takes well under a second here.
        ft = FaultTolerance(
            {"heartbeat_timeout_s": 5.0, "collective_timeout_s": 10.0, "join_timeout_s": 120.0}
        )
    except RunEnded:
        return  # a replacement that arrived after the last step
    torch.manual_seed(args.seed + (REPLACEMENT_SEED_OFFSET if ft.launch.replacement else 0))
    data = DigitsUpscaled()
    data.setup("fit")
    train_x, train_y = data.train_set.tensors
    val_x, val_y = data.val_set.tensors
    net = DigitsCNN()
    model = ft.wrap(net)
    optimizer = net.configure_optimizers()
    ft.track(optimizer)

    def maybe_die(point: str) -> None:
        if ft.uid == kill_uid and point == kill_point and ft.steps_committed == int(kill_step):
            os.kill(os.getpid(), signal.SIGKILL)

    net.features[0].weight.register_hook(lambda grad: (maybe_die("backward"), grad)[1])
    with open(os.path.join(args.out_dir, f"{ft.uid}.jsonl"), "a") as log:

        def record(kind: str, **fields: object) -> None:
            print(json.dumps({"kind": kind, "uid": ft.uid, **fields}), file=log, flush=True)

        while ft.steps_committed < args.steps:
            with ft.step() as outcome:
                batch = global_batch_indices(args.seed, ft.steps_committed, len(train_y))
                share = batch[ft.rank :: ft.world_size]
                optimizer.zero_grad()
                maybe_die("forward")
                logits = model(train_x[share])
                loss = nn.functional.cross_entropy(logits, train_y[share], reduction="sum")
                (loss * ft.world_size / GLOBAL_BATCH).backward()
            if not outcome.committed:
                continue
            optimizer.step()
            if ft.world_size < ft.launch.initial_world_size:
                time.sleep(args.degraded_pause_s)  # time for a replacement to arrive in a short run
            step, generation = ft.steps_committed, ft.generation
            record("step", step=step, generation=generation.number, world_size=ft.world_size, pid=os.getpid())
            if ft.rank == 0 and (step % args.val_every == 0 or step == args.steps):
                val_loss, val_acc = validate(net, val_x, val_y)
                record("val", step=step, val_loss=val_loss, val_acc=val_acc, world_size=ft.world_size)
        val_loss, val_acc = validate(net, val_x, val_y)
        stats = dataclasses.asdict(ft.stats)
        record(
            "end",
            step=ft.steps_committed,
            world_size=ft.world_size,
            generation=ft.generation.number,
            val_loss=val_loss,
            val_acc=val_acc,
            digest=digest(net),
            stats=stats,
        )
    ft.close()


if __name__ == "__main__":
    main()
