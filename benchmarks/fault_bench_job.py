"""The training job that benchmarks/bench_fault_tolerance.py times: one MLP, two ways of starting it.

    python -m lightning_ddpx.fault.launch --nproc 3 -- benchmarks/fault_bench_job.py ft OUT_DIR [options]
    RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=P benchmarks/fault_bench_job.py plain OUT_DIR [options]

``ft``: the bare module under :class:`~lightning_ddpx.fault.FaultTolerance` (modelled on tests/jobs/fault_job.py).
``plain``: today's recipe, ``torch.distributed.init_process_group`` (``env://``) and our
``DistributedDataParallel``, optionally resuming from a checkpoint (``--load-checkpoint``).

Each process appends JSON lines to ``OUT_DIR/<name>.jsonl`` (``name``: the launcher's uid, or ``rank<N>``),
flushed as they are written, so that a process killed with SIGKILL leaves what it had written:

- ``{"event": "mark", "what": ..., "t": ...}``: phases of the start (``start`` is taken before ``import torch``);
- ``{"event": "commit", "step": ..., "t": ..., "perf": ..., ...}``: after every applied step (``t``:
  ``time.time()``, comparable across processes; ``perf``: ``time.perf_counter()``, for step durations);
  ``ft`` adds the boundary's, the body's and the vote's durations (the time spent entering and leaving
  ``ft.step()``);
- ``{"event": "abort", ...}``: a step every member discarded;
- ``{"event": "interleaved", "kind": "ft" | "bare", "dt": ...}``: ``--interleave``'s steps;
- ``{"event": "stats", ...}``: at the end, ``ft.stats`` and the store's round trip.

``--kill UID:STEP`` makes process ``UID`` write ``time.time()`` to ``OUT_DIR/kill.txt`` and SIGKILL itself
in the backward of the step after ``STEP`` committed steps.
"""

from __future__ import annotations

import time

START = time.time()  # before the imports: the replacement's time to its first step counts them

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import IO, Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_ddpx import DistributedDataParallel  # noqa: E402
from lightning_ddpx.fault import FaultTolerance, RunEnded  # noqa: E402
from lightning_ddpx.fault.launch_env import launch_info_from_environment  # noqa: E402

IMPORTED = time.time()


def build_mlp(io: int, width: int, depth: int, seed: int) -> nn.Module:
    """``depth + 1`` Linear layers: ``io -> width``, ``depth - 1`` times ``width -> width``, ``width -> io``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(io, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, io))
    return nn.Sequential(*layers)


class Batches:
    """This rank's share of one fixed global batch, made once per (rank, world size): data generation is not
    part of the timed step, and a lost rank's share goes to the survivors."""

    def __init__(self, io: int, global_batch: int) -> None:
        self.io, self.global_batch, self._made = io, global_batch, {}

    def share(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rank, world_size)
        if key not in self._made:
            g = torch.Generator().manual_seed(0)
            x, y = (
                torch.randn(self.global_batch, self.io, generator=g),
                torch.randn(self.global_batch, self.io, generator=g),
            )
            rows = torch.arange(rank, self.global_batch, world_size)
            self._made[key] = (x[rows].contiguous(), y[rows].contiguous())
        return self._made[key]


class Log:
    """One JSON object per line, flushed at once."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a")  # noqa: SIM115 - closed in close()

    def write(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": event, **fields}) + "\n")
        self._file.flush()

    def mark(self, what: str, t: float | None = None) -> None:
        self.write("mark", what=what, t=time.time() if t is None else t)

    def close(self) -> None:
        self._file.close()


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()


# ------------------------------------------------------------------------------------------------- ft
def run_ft(args: argparse.Namespace) -> None:
    info = launch_info_from_environment()
    # The module is built before joining: the members wait at the newcomer's heal for everything it does
    # between its admission and its first step.
    net = build_mlp(args.io, args.width, args.depth, seed=1234 if info.replacement else 0)
    log = Log(os.path.join(args.out_dir, f"{info.uid}.jsonl"))
    log.mark("start", START)
    log.mark("imported", IMPORTED)
    log.write("pid", pid=os.getpid())
    log.mark("built")
    try:
        options = {"collective_timeout_s": args.collective_timeout_s} if args.collective_timeout_s else {}
        ft = FaultTolerance(options, launch=info)
    except RunEnded:
        log.close()
        return  # a replacement that arrived after the last step
    log.mark("admitted")
    model = ft.wrap(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=args.momentum)
    ft.track(optimizer)
    log.mark("wrapped")
    batches = Batches(args.io, args.global_batch)
    kill_uid, _, kill_step = args.kill.partition(":")
    if ft.uid == kill_uid:

        def die(grad: torch.Tensor) -> torch.Tensor:
            if ft.steps_committed == int(kill_step):
                with open(os.path.join(args.out_dir, "kill.txt"), "w") as f:
                    f.write(repr(time.time()))
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return grad

        net[2].weight.register_hook(die)  # mid-backward: the last layers' buckets are in flight

    healed_at: int | None = None
    while ft.steps_committed < args.steps:
        if healed_at is not None and ft.steps_committed >= healed_at + args.after_heal:
            break
        entered = time.perf_counter()
        body_started = body_ended = None
        with ft.step() as outcome:
            body_started, body_wall = time.perf_counter(), time.time()
            train = batches.share(ft.rank, ft.world_size)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(train[0]), train[1]).backward()
            body_ended = time.perf_counter()
        left = time.perf_counter()
        if not outcome.committed:
            log.write("abort", step=ft.steps_committed + 1, t=time.time())
            continue
        optimizer.step()
        if ft.steps_committed == args.save_checkpoint and ft.rank == 0:
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.out_dir, "checkpoint.pt"))
        log.write(
            "commit",
            step=ft.steps_committed,
            world=ft.world_size,
            generation=ft.generation.number,
            t=time.time(),
            perf=time.perf_counter(),
            t_body=body_wall,
            boundary_s=body_started - entered,
            body_s=body_ended - body_started,
            vote_s=left - body_ended,
        )
        if args.pause_s:
            time.sleep(args.pause_s)  # after the timestamp: the pause is not part of the step
        if args.after_heal and healed_at is None and ft.stats.newcomers_healed:
            healed_at = ft.steps_committed  # the same committed step on every member
    if args.interleave:
        interleave(args, ft, model, optimizer, batches, log)
    rtt = store_round_trip_s(ft.store) if args.interleave else None
    log.write("stats", store_round_trip_s=rtt, **dataclasses.asdict(ft.stats))
    ft.close()
    log.close()


def interleave(
    args: argparse.Namespace,
    ft: FaultTolerance,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    log: Log,
) -> None:
    """Blocks of steps through ``ft.step()`` and of the same steps without it, alternating, in the same
    processes on the same group: what the fault-tolerant step adds, with the machine's drift cancelled."""
    rounds, block = (int(v) for v in args.interleave.split(":"))

    def with_ft() -> None:
        with ft.step() as outcome:
            train = batches.share(ft.rank, ft.world_size)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(train[0]), train[1]).backward()
        if not outcome.committed:
            raise RuntimeError("fault_bench_job: a step failed while nothing was meant to fail")
        optimizer.step()

    def bare() -> None:
        train_step(model, optimizer, batches.share(ft.rank, ft.world_size))

    for r in range(rounds):
        for kind, step in (("ft", with_ft), ("bare", bare))[:: 1 if r % 2 == 0 else -1]:
            for _ in range(block):
                started = time.perf_counter()
                step()
                log.write("interleaved", kind=kind, round=r, dt=time.perf_counter() - started)


def store_round_trip_s(store: dist.Store, calls: int = 200) -> float:
    """One ``add(key, 0)`` on the launcher's store: a round trip that changes nothing."""
    started = time.perf_counter()
    for _ in range(calls):
        store.add("bench/round_trip", 0)
    return (time.perf_counter() - started) / calls


# ---------------------------------------------------------------------------------------------- plain
def run_plain(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    log = Log(os.path.join(args.out_dir, f"rank{rank}.jsonl"))
    log.mark("start", START)
    log.mark("imported", IMPORTED)
    log.write("pid", pid=os.getpid())
    dist.init_process_group("gloo", init_method="env://")
    world_size = dist.get_world_size()
    log.mark("process_group")
    net = build_mlp(args.io, args.width, args.depth, seed=0)
    log.mark("built")
    state = None
    if args.load_checkpoint:
        state = torch.load(args.load_checkpoint, weights_only=True)
        net.load_state_dict(state["model"])
        log.mark("loaded")
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=args.momentum)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    log.mark("wrapped")
    train = Batches(args.io, args.global_batch).share(rank, world_size)
    for step in range(1, args.steps + 1):
        entered = time.perf_counter()
        train_step(model, optimizer, train)
        log.write("commit", step=step, world=world_size, t=time.time(), perf=time.perf_counter(),
                  step_s=time.perf_counter() - entered)  # fmt: skip
    model.close()
    dist.destroy_process_group()
    log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=("ft", "plain"))
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=10, help="committed steps to run (ft: at most)")
    parser.add_argument("--io", type=int, default=256, help="the MLP's input and output features")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden features")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers")
    parser.add_argument("--global-batch", type=int, default=288, help="samples per step over all ranks")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--pause-s", type=float, default=0.0, help="sleep after each committed step")
    parser.add_argument("--kill", default="", metavar="UID:STEP")
    parser.add_argument("--save-checkpoint", type=int, default=0, metavar="STEP", help="rank 0 saves it")
    parser.add_argument("--load-checkpoint", default="", metavar="PATH")
    parser.add_argument("--collective-timeout-s", type=float, default=0.0, help="ft: 0 = the default")
    parser.add_argument("--after-heal", type=int, default=0, help="ft: stop this many steps after a heal")
    parser.add_argument("--interleave", default="", metavar="ROUNDS:BLOCK")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.mode == "ft":
        run_ft(args)
    else:
        run_plain(args)
    # Everything is written and closed: skip the interpreter's teardown of torch, which takes seconds of a
    # loaded 2-core machine (and of the benchmark's time) after every run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
