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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from lightning_ddpx._compat.torch import JoinConfig
from lightning_ddpx.engine.buckets import hook_views
from lightning_ddpx.engine.consistency import broadcast_from
from lightning_ddpx.engine.cuda_streams import current_stream, on_stream
from lightning_ddpx.engine.diagnosis import bucket_checked
from lightning_ddpx.engine.errors import waiting_for
from lightning_ddpx.engine.grad_bucket import GradBucket
from lightning_ddpx.engine.profiling import label
from lightning_ddpx.engine.reducer import Phase, Reducer
from lightning_ddpx.engine.sparse import empty_sparse_like

if TYPE_CHECKING:
    from lightning_ddpx.engine.module import DistributedDataParallel

__all__ = ["DDPXJoinHook", "JoinRound", "JoinableModule", "announce", "shadow_reduction"]

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
    module: DistributedDataParallel,
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

    def __init__(self, module: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        super().__init__()
        self.module = module
        module._join_divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        module = self.module
        reducer = module.reducer
        round_ = announce(module, active=False)
        if round_.rebuild_src is not None:
            reducer.rebuild_buckets_from(round_.rebuild_src)
        # the others compare every rank's settings before their first collective (announced only then):
        # the buffers' broadcast, else their first reduction
        if round_.verify:
            module._settings_verified = False
            module._verify_settings_once()
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
        module._join_config = JoinConfig.construct_disabled_join_config()
        module.reducer.transport.set_divisor(module.world_size)
        candidate = torch.tensor([module.rank if is_last_joiner else -1], device=module.device)
        with waiting_for("the last rank to join (end of join())", module.process_group):
            dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=module.process_group)
            src = int(candidate.item())
            # torch's ignore list: those parameters and buffers stay each rank's own, as in torch
            tensors = [p.detach() for _, p in module.synced_parameters()]
            if module.broadcast_buffers:
                tensors += module.synced_buffers.tensors()
            broadcast_from(tensors, module.process_group, src)


class JoinableModule(Joinable):
    """torch's :class:`~torch.distributed.algorithms.join.Joinable` interface of
    :class:`~lightning_ddpx.DistributedDataParallel`: ``join()``, the hook a joined rank runs, and what
    each forward inside ``join()`` announces. The module provides what it reads: its ``reducer``,
    ``device``, ``process_group``, ``world_size`` and ``_settings_verified``."""

    reducer: Reducer
    device: torch.device
    process_group: dist.ProcessGroup
    world_size: int
    _settings_verified: bool
    _join_divide_by_initial_world_size: bool

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Train on uneven inputs: ``with model.join(): for batch in my_batches: ...`` (torch's semantics).

        A rank that runs out of batches leaves the loop and, inside the context's exit, shadows the others'
        collectives with zero gradients (through the registered hook, so PowerSGD's collectives match too)
        until every rank has run out; then every rank takes the model of the last rank to finish.
        Gradients are averaged over the initial world size, or, with ``divide_by_initial_world_size=False``,
        over the ranks still training (default hook only: a registered hook divides as it always does,
        as in torch). ``throw_on_early_termination=True`` raises on every rank at the first forward after
        one rank ran out, instead. Equivalent to ``torch.distributed.algorithms.join.Join([model], ...)``;
        collectives outside this module (e.g. SyncBatchNorm, all_gather in the loop) are not shadowed:
        use ``throw_on_early_termination=True`` with those, as torch advises.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook torch's ``Join`` runs on a rank that has joined (``divide_by_initial_world_size``)."""
        return DDPXJoinHook(
            self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True)
        )

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _announce_to_joined_ranks(self, will_sync: bool, sync_buffers: bool) -> tuple[int, int]:
        """Inside ``join()``: tell the context and any joined rank what this forward communicates.

        Returns the ranks to rebuild buckets and broadcast buffers from: ranks that joined hold stale ones.
        """
        work = Join.notify_join_context(self)  # raises here with throw_on_early_termination=True
        round_ = announce(
            self,
            active=True,
            will_sync=will_sync,
            will_verify=(will_sync or sync_buffers) and not self._settings_verified and self.world_size > 1,
            will_rebuild=will_sync and self.reducer.planner.rebuild_pending,
            will_broadcast_buffers=sync_buffers,
            will_share_bitmap=will_sync and self.reducer.shares_used_bitmap,
        )
        if work is not None:
            work.wait()
        divide_by_all = (
            self._join_divide_by_initial_world_size or self._join_config.throw_on_early_termination
        )
        # average over the ranks still training (default path only: a registered hook divides itself)
        self.reducer.transport.set_divisor(self.world_size if divide_by_all else len(round_.active))
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
    if reducer.phase is not Phase.IDLE:
        raise RuntimeError("lightning_ddpx: a joined rank cannot shadow while its own backward is reducing")
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
            call = on_stream(current_stream(zeros.device), lambda gb=grad_bucket: transport.shadow(gb))
            if reducer.progress.debug:  # counted as if this rank ran the forward it shadows
                counters = (reducer.forwards_armed + 1, reducer.reductions + 1)
                call = bucket_checked(call, reducer.process_group, b, bucket.spec, counters)
            launched.append((b, transport.launcher.submit(call)))
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
