"""A fault-tolerant training job for the tests: the bare module under ``python -m lightning_ddpx.fault.launch``.

    python -m lightning_ddpx.fault.launch --nproc 3 --replacements 1 -- tests/jobs/fault_job.py OUT_DIR STEPS [KILL]

Each process trains the same small model (seed 0) with data keyed on (committed step, rank, world size), and
appends, after every committed step, ``uid pid generation world_size step digest`` to ``OUT_DIR/<uid>.log``
(the digest: a hash of the parameters' bytes), and with PowerSGD ``step iteration digest`` of its shared
state (with DiLoCo ``step inner_steps digest`` of its anchors) to ``OUT_DIR/<uid>.hook``. ``KILL`` = ``uid:step:point`` makes process ``uid`` kill
itself with SIGKILL at attempt ``step`` (a committed-step count), at ``point``: ``forward``, ``backward``
(from a gradient hook, buckets in flight), ``optimizer`` (after the step was committed, before it is
applied), ``boundary`` (before the step starts), or ``save`` (inside ``save_checkpoint``, before its file
replaces the last one: with ``FAULT_JOB_CHECKPOINT=path`` and ``FAULT_JOB_CHECKPOINT_EVERY=k``), or
``stall`` (stopped with SIGSTOP mid-backward, silent rather than dead, and resumed ``FAULT_JOB_STALL_S``
seconds later); ``raise`` makes it raise a communication failure inside
the step without dying (the fail-at injection: every member discards the step, nobody is lost);
``hang`` keeps it alive but stuck after its backward, never voting;
``FAULT_JOB_OWN_BATCHES=1`` makes the loop take its batches from its own counter instead (one per attempt,
a discarded one skipped, as a loop over a data loader would), all-reduce a metric between steps through
``ft.outside_step``, and append ``step batch metric`` after each committed step to ``OUT_DIR/<uid>.batches``;
``between`` then makes that metric's all-reduce after that step fail on that process alone (issued first:
the others' succeeds).
``collective`` makes its second all-reduce of that step (a bucket's, mid-backward) fail on it alone (the
others' collectives all succeed); ``unissued`` makes it raise there instead of issuing that all-reduce (a
local error inside a hook, between two of its collectives); ``sync``
(DiLoCo) right before an outer step, which the others then run without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddpx.engine.agreement.errors import CommunicationError
from lightning_ddpx.fault import FaultTolerance, RunEnded
from lightning_ddpx.fault.launch import KEY_DEAD_COUNT, KEY_INITIAL_WORLD_SIZE, KEY_REPLACEMENTS_STARTED


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def hook_digest(shared: dict) -> str:
    """A hash of PowerSGD's shared state: the seed generator and every warm-start Q."""
    h = hashlib.sha256(shared["rng_state"].numpy().tobytes())
    for index in sorted(shared["q"]):
        q = shared["q"][
            index
        ]  # bfloat16 inside the bf16 wrapper: numpy has no such type, its bits hash alike
        h.update((q.view(torch.int16) if q.dtype == torch.bfloat16 else q).numpy().tobytes())
    return h.hexdigest()[:16]


def hook_record(shared: dict) -> tuple[int, str]:
    """PowerSGD's iteration and shared-state digest, or DiLoCo's inner-step count and anchors' digest."""
    if "anchors" in shared:
        h = hashlib.sha256()
        for anchor in shared["anchors"]:
            h.update(anchor.numpy().tobytes())
        return shared["step"], h.hexdigest()[:16]
    return shared["iteration"], hook_digest(shared)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (24 samples), this rank's share of it."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g)
    share = [i for i in range(24) if i % world_size == rank]
    return x[share], y[share]


def fail_at_a_collective(ft: FaultTolerance, step: int, me: str, injected: list, issued: bool = True) -> None:
    """Make this process's second all-reduce of committed step ``step`` (a bucket's, mid-backward) fail here
    only, once. ``issued``: it is issued, so the others' collective completes, and then raises a
    communication failure on this process (the others' collectives all succeed; this member's do not).
    Otherwise it raises instead of issuing it, as a local error between two collectives of a hook would."""
    real_allreduce = dist.ProcessGroup.allreduce
    calls = []

    def failing_allreduce(group, *args, **kwargs):
        if ft.steps_committed == step and not injected:
            calls.append(1)
            if len(calls) == 2:
                injected.append(True)
                if issued:
                    real_allreduce(group, *args, **kwargs)
                    raise CommunicationError(
                        f"injected failure at an all-reduce of process {me} at step {step}"
                    )
                raise RuntimeError(
                    f"injected local error before an all-reduce of process {me} at step {step}"
                )
        return real_allreduce(group, *args, **kwargs)

    dist.ProcessGroup.allreduce = failing_allreduce


def metric_between_steps(ft: FaultTolerance, me: str, fail: bool, at_step: int) -> float:
    """An all-reduce between steps of a rank-dependent value, through ``ft.outside_step`` (as a logged
    metric's would be); with ``fail`` at committed step ``at_step`` it fails on this process alone, once,
    after it was issued. Returns what this process got."""
    failed = []

    def reduce() -> torch.Tensor:
        value = torch.tensor([float(ft.rank + 1)])
        dist.all_reduce(value)
        if fail and ft.steps_committed == at_step and not failed:
            failed.append(True)
            raise CommunicationError(f"injected failure between steps in process {me}")
        return value

    return float(ft.outside_step(reduce, lambda: torch.zeros(1)))


_LOSSES_DECIDED = [0]  # losses whose replace-or-not decision by the launcher this process has seen


def wait_for_a_started_replacement(ft: FaultTolerance, timeout_s: float = 90.0) -> None:
    """While a member is missing: if the launcher started a replacement that this member has not seen
    register yet, wait until it has (at most ``timeout_s``), so that it is admitted at the next boundary
    that admits however slowly it starts on a loaded machine; with no replacement on its way, return at
    once. "Seen" as the vote sees joiners (``Membership.joiners_seen``: the heartbeat thread's last read).
    The launcher records a loss a moment before it counts the replacement it starts: a loss not yet seen
    here gets up to 2 s for that decision, once."""
    store = ft.store
    dead = int(store.add(KEY_DEAD_COUNT, 0))
    if dead > _LOSSES_DECIDED[0]:
        decided = time.monotonic() + 2.0
        while int(store.add(KEY_REPLACEMENTS_STARTED, 0)) < dead and time.monotonic() < decided:
            time.sleep(0.02)
        _LOSSES_DECIDED[0] = dead
    expected = int(store.get(KEY_INITIAL_WORLD_SIZE)) + int(store.add(KEY_REPLACEMENTS_STARTED, 0))
    deadline = time.monotonic() + timeout_s
    while ft.membership.joiners_seen() < expected and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    kill_uid, kill_step, kill_point = (
        (sys.argv[3].split(":") + ["", "", ""])[:3] if len(sys.argv) > 3 else ("", "", "")
    )
    # with FAULT_JOB_FULL_WORLD, while fewer members train, each step waits for a replacement the launcher
    # started to register (admitted at the next boundary that admits, however slow the machine is)
    full_world = int(os.environ.get("FAULT_JOB_FULL_WORLD", "0"))
    try:
        ft = FaultTolerance(
            {
                "heartbeat_timeout_s": float(os.environ.get("FAULT_JOB_HEARTBEAT_S", "5")),
                "collective_timeout_s": float(os.environ.get("FAULT_JOB_COLLECTIVE_S", "20")),
                "join_timeout_s": float(os.environ.get("FAULT_JOB_JOIN_S", "60")),
            }
        )
    except RunEnded:
        return  # a replacement that arrived after the last step
    me = ft.uid
    torch.manual_seed(0 if not ft.launch.replacement else 1234)  # a newcomer starts from other values
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    hook = os.environ.get("FAULT_JOB_HOOK") or None  # e.g. "fp16"
    options = json.loads(os.environ.get("FAULT_JOB_DDP_OPTIONS") or "{}")  # e.g. {"static_graph": true}
    model = ft.wrap(net, bucket_cap_mb=0.0001, comm_hook=hook, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ft.track(optimizer)

    injected = []

    def maybe_die(point: str) -> None:
        if me == kill_uid and point == kill_point == "stall" and ft.steps_committed == int(kill_step):
            # silent, not dead: stopped (its heartbeat thread too), resumed later by a detached sleeper
            resume_after = os.environ.get("FAULT_JOB_STALL_S", "8")
            subprocess.Popen(
                ["sh", "-c", f"sleep {resume_after}; kill -CONT {os.getpid()}"], start_new_session=True
            )
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if me == kill_uid and point == kill_point and ft.steps_committed == int(kill_step):
            os.kill(os.getpid(), signal.SIGKILL)
        if me == kill_uid and kill_point == "raise" and point == "forward" and not injected:
            if ft.steps_committed == int(kill_step):
                injected.append(True)
                raise CommunicationError(f"injected failure in process {me} at step {kill_step}")

    checkpoint = os.environ.get("FAULT_JOB_CHECKPOINT")  # save every FAULT_JOB_CHECKPOINT_EVERY steps
    every = int(os.environ.get("FAULT_JOB_CHECKPOINT_EVERY", "0"))
    if checkpoint and os.environ.get("FAULT_JOB_RESUME") and ft.load_checkpoint(checkpoint):
        with open(os.path.join(out_dir, f"{me}.resumed"), "w") as resumed:
            print(ft.steps_committed, digest(net), file=resumed)
    if kill_point == "save":  # killed inside save_checkpoint, before its file replaces the last one
        real_replace = os.replace

        def replace(source, target):
            if me == kill_uid and ft.steps_committed == int(kill_step):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(source, target)

        os.replace = replace
    if kill_point in ("backward", "stall"):
        net[0].weight.register_hook(lambda g: (maybe_die(kill_point), g)[1])
    if kill_point in ("collective", "unissued") and me == kill_uid:
        fail_at_a_collective(ft, int(kill_step), me, injected, issued=kill_point == "collective")
    own_batches = bool(os.environ.get("FAULT_JOB_OWN_BATCHES"))
    batch_index = -1  # with own_batches: the loop's own counter, one per attempt
    with open(os.path.join(out_dir, f"{me}.log"), "a") as log:
        while ft.steps_committed < steps:
            maybe_die("boundary")
            batch_index += 1
            with ft.step() as outcome:
                x, y = batch(batch_index if own_batches else ft.steps_committed, ft.rank, ft.world_size)
                optimizer.zero_grad()
                maybe_die("forward")
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                if me == kill_uid and kill_point == "hang" and ft.steps_committed == int(kill_step):
                    while True:  # alive (its heartbeat moves) but never votes: stuck outside the collectives
                        time.sleep(1)
            if outcome.committed:
                maybe_die("optimizer")
                optimizer.step()
                averaging = model.parameter_averaging  # DiLoCo: its outer step, when due
                if averaging is not None and averaging.due_next():
                    maybe_die("sync")
                ft.average_after_step()
                if full_world and ft.world_size < full_world:
                    wait_for_a_started_replacement(ft)
                g = ft.generation
                print(
                    me,
                    os.getpid(),
                    g.number,
                    len(g.members),
                    ft.steps_committed,
                    digest(net),
                    file=log,
                    flush=True,
                )
                shared = ft.hook_state_dict()  # the hook's shared state: equal on every member, always
                if shared is not None and ("iteration" in shared or "anchors" in shared):
                    with open(os.path.join(out_dir, f"{me}.hook"), "a") as hook_log:
                        print(ft.steps_committed, *hook_record(shared), file=hook_log)
                if checkpoint and every and ft.steps_committed % every == 0:
                    ft.save_checkpoint(checkpoint)
                if own_batches:
                    metric = metric_between_steps(
                        ft, me, kill_point == "between" and me == kill_uid, int(kill_step or -1)
                    )
                    with open(os.path.join(out_dir, f"{me}.batches"), "a") as batches:
                        print(ft.steps_committed, batch_index, metric, file=batches)
    print(f"{me} done: {ft.stats}", flush=True)
    with open(os.path.join(out_dir, f"{me}.metrics.json"), "w") as metrics:  # what a logger would get
        json.dump(ft.stats.metrics(), metrics, sort_keys=True)
    ft.close()


if __name__ == "__main__":
    main()
