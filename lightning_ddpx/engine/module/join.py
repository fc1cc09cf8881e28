"""Uneven inputs on the module: torch's ``join()`` protocol for :class:`lightning_ddpx.DistributedDataParallel`.

torch's :class:`~torch.distributed.algorithms.join.Join` drives it: every forward of a rank that still has
inputs first calls ``Join.notify_join_context`` (an allreduce of "I have not joined"); a rank that ran out
sits in ``Join.__exit__`` matching that allreduce and, while some rank is still training, runs our
:class:`DDPXJoinHook.main_hook` once per forward of the others. The hook *shadows* the iteration: it issues
the same collectives, in the same order, with zero contributions.

What the shadowing rank must mirror depends on the active ranks (do they synchronise this forward, rebuild
buckets, broadcast buffers?), which it cannot know by itself -- a rank with no inputs at all never saw a
backward. torch answers one of these questions with a flag allreduce per forward; here one small allreduce
(:func:`announce`) carries all of them, per rank, so the shadow follows the active ranks exactly:

    active rank:  [notify] -> announce(mine)  -> verify? -> rebuild? -> buffers? -> forward -> buckets -> bitmap
    joined rank:  [count]  -> announce(zeros) -> verify? -> rebuild? -> buffers? ------------> buckets -> bitmap

Buckets are reduced by the registered communication hook on zero buffers, so stateful hooks (PowerSGD:
its P and Q allreduces, its iteration counter) issue the same collectives on every rank. When all ranks
have joined, the model of the last rank to join is broadcast to all (torch's ``_sync_final_model``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from lightning_ddpx.engine.agreement.consistency import broadcast_from
from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.agreement.sequence_check import bucket_checked
from lightning_ddpx.engine.buckets.grad_bucket import GradBucket
from lightning_ddpx.engine.buckets.sparse import empty_sparse_like
from lightning_ddpx.engine.buckets.storage import hook_views
from lightning_ddpx.engine.profiling import label
from lightning_ddpx.engine.reducer.reducer import Reducer
from lightning_ddpx.engine.transport.cuda_streams import current_stream

__all__ = ["DDPXJoinHook", "JoinPeer", "JoinRound", "announce", "announce_forward", "shadow_reduction"]


class JoinPeer(Protocol):
    """What join asks of :class:`~lightning_ddpx.DistributedDataParallel`: public members only."""

    reducer: Reducer
    device: torch.device
    process_group: dist.ProcessGroup
    world_size: int
    rank: int
    broadcast_buffers: bool
    synced_buffers: Any

    def synced_parameters(self) -> list[tuple[str, torch.nn.Parameter]]: ...

    def verify_settings(self, again: bool = False) -> None: ...

    def end_join(self) -> None: ...


# Rows of the per-forward announcement; one column per rank.
_ACTIVE, _SYNC, _VERIFY, _REBUILD, _BUFFERS, _BITMAP = range(6)


@dataclass(frozen=True)
class JoinRound:
    """What the ranks that have not joined announced for one forward."""

    active: tuple[int, ...]  # ranks that still have inputs
    syncing: bool  # this forward's backward reduces gradients (not no_sync, grad enabled)
    verify: bool  # the ranks compare their settings (before their first buffer broadcast or reduction)
    bitmap: bool  # their backward all-reduces the used-parameter bitmap after the buckets
    rebuild_src: int | None  # the rank whose observed gradient order rebuilds the buckets, if any
    buffers_src: int | None  # the rank whose buffers are broadcast before forward, if any


def announce(
    module: JoinPeer,
    active: bool,
    will_sync: bool = False,
    will_verify: bool = False,
    will_rebuild: bool = False,
    will_broadcast_buffers: bool = False,
    will_share_bitmap: bool = False,
) -> JoinRound:
    """One allreduce telling every rank (joined ones included) what this forward will communicate.

    A joined rank calls it with ``active=False``: it contributes nothing and learns what to shadow.
    """
    world_size, rank = module.world_size, module.rank
    module.reducer.progress.record(
        "the join() announcement before a forward" + ("" if active else " (shadowing)")
    )
    flags = torch.zeros(6, world_size, dtype=torch.int32, device=module.device)
    if active:
        flags[_ACTIVE, rank] = 1
        flags[_SYNC, rank] = int(will_sync)
        flags[_VERIFY, rank] = int(will_verify)
        flags[_REBUILD, rank] = int(will_rebuild)
        flags[_BUFFERS, rank] = int(will_broadcast_buffers)
        flags[_BITMAP, rank] = int(will_share_bitmap)
    with waiting_for(
        "the other ranks' join announcement for this forward (uneven inputs)", module.process_group
    ):
        dist.all_reduce(flags, group=module.process_group)
    rows = flags.cpu().tolist()
    ranks = tuple(r for r in range(world_size) if rows[_ACTIVE][r])
    rebuilders = [r for r in range(world_size) if rows[_REBUILD][r]]
    return JoinRound(
        active=ranks,
        syncing=any(rows[_SYNC]),
        verify=any(rows[_VERIFY]),
        bitmap=any(rows[_BITMAP]),
        rebuild_src=min(rebuilders) if rebuilders else None,
        # torch's choice: the highest rank that has not joined holds the freshest buffers
        buffers_src=max(ranks) if any(rows[_BUFFERS]) and ranks else None,
    )


class DDPXJoinHook(JoinHook):
    """Shadows the active ranks' collectives while this rank has joined; syncs the final model after."""

    def __init__(self, module: JoinPeer) -> None:
        super().__init__()
        self.module = module

    def main_hook(self) -> None:
        module = self.module
        reducer = module.reducer
        round_ = announce(module, active=False)
        if round_.rebuild_src is not None:
            reducer.rebuild_buckets_from(round_.rebuild_src)
        # the others compare every rank's settings before their first collective (announced only then):
        # the buffers' broadcast, else their first reduction
        if round_.verify:
            module.verify_settings(again=True)
        if round_.buffers_src is not None:
            with waiting_for(
                f"rank {round_.buffers_src}'s buffers before forward (shadowing a joined rank)",
                module.process_group,
            ):
                broadcast_from(module.synced_buffers.tensors(), module.process_group, round_.buffers_src)
        if round_.syncing:
            shadow_reduction(reducer, bitmap=round_.bitmap)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank ends with the model of the last rank to join (ties: the highest such rank)."""
        module = self.module
        module.end_join()
        candidate = torch.tensor([module.rank if is_last_joiner else -1], device=module.device)
        with waiting_for("the last rank to join (end of join())", module.process_group):
            dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=module.process_group)
            src = int(candidate.item())
            # torch's ignore list: those parameters and buffers stay each rank's own, as in torch
            tensors = [p.detach() for _, p in module.synced_parameters()]
            if module.broadcast_buffers:
                tensors += module.synced_buffers.tensors()
            broadcast_from(tensors, module.process_group, src)


def announce_forward(
    module: JoinPeer, will_sync: bool, sync_buffers: bool, divide_by_all: bool
) -> tuple[int, int]:
    """Inside ``join()``, before a forward of a rank that still has inputs: tell the context and any joined
    rank what this forward communicates; set the default path's divisor (``divide_by_all``: the initial
    world size, else the ranks still training; a registered hook divides itself).

    Returns the ranks to rebuild buckets and broadcast buffers from: ranks that joined hold stale ones.
    """
    work = Join.notify_join_context(module)  # raises here with throw_on_early_termination=True
    reducer = module.reducer
    round_ = announce(
        module,
        active=True,
        will_sync=will_sync,
        will_verify=(will_sync or sync_buffers) and not reducer.settings_verified and module.world_size > 1,
        will_rebuild=will_sync and reducer.planner.rebuild_pending,
        will_broadcast_buffers=sync_buffers,
        will_share_bitmap=will_sync and reducer.shares_used_bitmap,
    )
    if work is not None:
        work.wait()
    reducer.transport.set_divisor(module.world_size if divide_by_all else len(round_.active))
    return (
        round_.rebuild_src if round_.rebuild_src is not None else 0,
        round_.buffers_src if round_.buffers_src is not None else 0,
    )


def shadow_reduction(reducer: Reducer, bitmap: bool) -> None:
    """Reduce one iteration with zero gradients, as a rank that has joined.

    Every bucket goes through the reducer's transport, in bucket order, exactly like a real backward, then
    the used-parameter bitmap (all zeros) when the active ranks share theirs (``bitmap``); results are
    discarded.
    """
    reducer.require_between_iterations(
        "lightning_ddpx: a joined rank cannot shadow while its own backward is reducing"
    )
    transport, buckets = reducer.transport, reducer.buckets
    launched: list[tuple[int, torch.futures.Future]] = []
    transport.begin_reduction()  # as the active ranks' transports do when their backward starts
    with label("lightning_ddpx::join_shadow"):
        for b, bucket in enumerate(buckets):
            if bucket.spec.sparse:
                zeros, views = empty_sparse_like(bucket.params[0]), []
            else:
                zeros = torch.zeros_like(bucket.buffer)
                views = hook_views(zeros, bucket.spec, bucket.params)  # what the hook sees, as torch's
            grad_bucket = GradBucket(
                b, zeros, views, bucket.params, b == len(buckets) - 1, names=bucket.names
            )
            reducer.progress.record(
                "bucket {} of {} ({}), shadowing (joined)", b, len(buckets), transport.name
            )
            call = functools.partial(transport.shadow, grad_bucket)
            if reducer.progress.debug:  # counted as if this rank ran the forward it shadows
                counters = (reducer.forwards_armed + 1, reducer.reductions + 1)
                call = bucket_checked(call, reducer.process_group, b, bucket.spec, counters)
            launched.append((b, transport.launcher.submit(call, stream=current_stream(zeros.device))))
        used = reducer.launch_used_bitmap() if bitmap else None
        for b, future in launched:
            what = (
                f"bucket {b} (parameters {buckets[b].short_names()}), shadowed with zeros by this joined rank"
            )
            with waiting_for(what, reducer.process_group):
                future.wait()
        if used is not None:
            with waiting_for(
                "the used-parameter bitmap, shadowed by this joined rank", reducer.process_group
            ):
                used.wait()
    reducer.forwards_armed += 1
    reducer.reductions += 1
