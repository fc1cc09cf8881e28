"""One "node" of the two-node test (tests/lightning/test_multinode_veth.py): a Lightning fit with DDPXStrategy.

Run inside a network namespace of a :class:`lightning_ddpx.bench.netns.VethLink`, once per node, as a real
multi-node job is launched: the same script on every node with ``MASTER_ADDR`` (node 0's veth address),
``MASTER_PORT`` and ``NODE_RANK`` in the environment, and ``num_nodes=2, devices=1`` in the Trainer. No
``LOCAL_RANK``: Lightning's ``LightningEnvironment`` is picked and its launcher has no process to start.

    python tests/jobs/veth_node.py --out DIR --steps 6 [--pause-after 3] [--timeout-s 8]

Writes to ``DIR``: ``params-<rank>.pt`` (final parameters) and ``info-<rank>.json`` after a fit;
``error-<rank>.json`` (exception type, message, when) and exit code 3 if the fit raised. With
``--pause-after K`` it writes ``ready-<rank>`` after training step K and waits for a file ``go`` (which the
test writes once it has cut the link) before the next step, so the link goes down at a known point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402

from lightning_ddpx import DDPXStrategy  # noqa: E402
from tests.strategy_helpers import fit, parameters_of, quiet  # noqa: E402

GO_WAIT_S = 120.0  # how long a paused node waits for the test's "go" before giving up


class PauseAfterStep(Callback):
    """After step ``step``: announce ``ready-<rank>``, then wait for ``go`` (the link is cut meanwhile)."""

    def __init__(self, out: Path, step: int) -> None:
        self.out = out
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        (self.out / f"ready-{trainer.global_rank}").write_text(str(time.time()))
        deadline = time.monotonic() + GO_WAIT_S
        while not (self.out / "go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"node {trainer.node_rank}: no 'go' file in {self.out} after {GO_WAIT_S} s"
                )
            time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pause-after", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    quiet()
    torch.set_num_threads(1)
    rank = int(os.environ["NODE_RANK"])  # one process per node: global rank == node rank
    callbacks = [PauseAfterStep(args.out, args.pause_after)] if args.pause_after is not None else []
    strategy = DDPXStrategy(timeout=timedelta(seconds=args.timeout_s))
    try:
        trainer, model = fit(strategy, args.steps, devices=1, num_nodes=2, callbacks=callbacks)
    except Exception as error:  # noqa: BLE001 - report whatever ended the fit to the test
        record = {"type": type(error).__name__, "message": str(error), "time": time.time()}
        (args.out / f"error-{rank}.json").write_text(json.dumps(record))
        print(f"node {rank}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 3
    torch.save(parameters_of(model), args.out / f"params-{trainer.global_rank}.pt")
    info = {
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "node_rank": trainer.node_rank,
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "global_step": trainer.global_step,
    }
    (args.out / f"info-{trainer.global_rank}.json").write_text(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
