"""The DDP protocol: gradient readiness, in-order bucket launch, the unused-parameter bitmap, finalize.

An iteration moves through named phases:

- ``IDLE``: no synchronisation expected (``no_sync``, evaluation, or between iterations). Gradient hooks
  return at once and gradients accumulate locally in ``param.grad`` (one that arrives after a synchronised
  backward, before the next forward, is named once: :mod:`~lightning_ddpx.engine.reducer.late_gradients`).
- ``ARMED``: a synchronising forward ran; the first gradient hook of backward starts reduction.
- ``REDUCING``: backward is running. Each ready gradient is counted in its bucket; a complete bucket is
  launched through the transport once every lower-index bucket has been launched. At the end of backward
  the autograd engine calls :meth:`Reducer._finalize`, which waits for the results in bucket order and
  writes averaged gradients into ``param.grad`` (or hands each bucket to the optimizer overlap).

What the reducer delegates, each to a unit with a narrow interface: bucket storage, filling and write-back
(:mod:`~lightning_ddpx.engine.buckets.storage`), the collectives (:mod:`~lightning_ddpx.engine.transport.transports`, chosen
once), result checks (:mod:`~lightning_ddpx.engine.reducer.bucket_results`), statistics
(:mod:`~lightning_ddpx.engine.reducer.comm_stats`), CUDA streams (:mod:`~lightning_ddpx.engine.transport.cuda_streams`), a
joined rank's shadow reductions (:mod:`~lightning_ddpx.engine.module.join`) and static graphs
(:mod:`~lightning_ddpx.engine.reducer.static_graph`).
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx._compat.torch import queue_backward_callback
from lightning_ddpx.engine.agreement.progress_board import ProgressBoard
from lightning_ddpx.engine.agreement.sequence_check import bucket_checked
from lightning_ddpx.engine.buckets.grad_bucket import GradBucket, payload_bytes
from lightning_ddpx.engine.buckets.plan import BucketInfo
from lightning_ddpx.engine.buckets.replanning import BucketPlanner
from lightning_ddpx.engine.buckets.sparse import refuse_dense_only_hook
from lightning_ddpx.engine.buckets.storage import Bucket
from lightning_ddpx.engine.profiling import label
from lightning_ddpx.engine.reducer import messages
from lightning_ddpx.engine.reducer.accumulator_hooks import AccumulatorHooks, PostHook
from lightning_ddpx.engine.reducer.backward_start import BackwardStart
from lightning_ddpx.engine.reducer.bucket_results import wait_result
from lightning_ddpx.engine.reducer.comm_stats import CommStatsRecorder
from lightning_ddpx.engine.reducer.late_gradients import warn_local_gradient
from lightning_ddpx.engine.reducer.reachability import unreachable_parameter_indices
from lightning_ddpx.engine.reducer.results_in_order import ResultsInOrder
from lightning_ddpx.engine.reducer.static_graph import StaticGraph
from lightning_ddpx.engine.reducer.usage_log import UsageLog
from lightning_ddpx.engine.reducer.used_parameters import UsedParameters
from lightning_ddpx.engine.transport.cuda_streams import GradientStreams, current_stream, wait_streams
from lightning_ddpx.engine.transport.transports import (
    CommHook,
    LocalGradients,
    Transport,
    UndecidedDefault,
    choose_default,
    hook_name,
)

__all__ = ["CommHook", "Phase", "Reducer"]


class Phase(enum.Enum):
    IDLE = "idle"
    ARMED = "armed"
    REDUCING = "reducing"


def _nothing() -> None:
    pass


class Reducer:
    """Averages gradients of ``params`` across ``process_group`` during backward, bucket by bucket."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        first_cap_bytes: int,
        cap_bytes: int,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        static_graph: bool = False,
        sparse_gradients: Sequence[bool] | None = None,
        shared_memory_obstacles: Sequence[int] | None = None,
        usage_log: UsageLog | None = None,
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.first_cap_bytes, self.cap_bytes = first_cap_bytes, cap_bytes
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.usage_log = usage_log  # records the errors backward raises (torch's usage logger)
        self._set_params(params, names, sparse_gradients, UsedParameters(len(params)))
        # every rank's shared-memory obstacles, when a collective at construction already carried them
        self._obstacles = None if shared_memory_obstacles is None else list(shared_memory_obstacles)
        self.transport: Transport = self._default_transport()
        self.overlap: Any = None  # engine.optimizer_overlap (set_overlap): it shapes the bucket plan
        self.in_backward: Any = None  # engine.optim_in_backward: torch's optimizers in backward, taken over
        self.before_reduction: Callable[[], None] = _nothing  # the module's settings check
        # The module's flags about this reducer: a new reducer (pickling, a changed trainable set) starts anew
        self.hook_registered = False  # register_comm_hook ran (the default path otherwise)
        self.settings_verified = False  # every rank's settings compared (before the first collective)
        self.in_backward_seen = 0  # torch's _apply_optimizer_in_backward registrations when last looked at
        self.stats = CommStatsRecorder()
        self.progress = ProgressBoard(process_group)  # what this rank last started, for hang reports
        self.phase = Phase.IDLE
        self.iterations_synced = 0  # completed synchronised backwards
        # Synchronising forwards and reductions so far, shadowed ones (join) included: DDPX_DEBUG compares them.
        self.forwards_armed = self.reductions = 0
        # True from the end of a synchronised backward until the next forward (or no_sync()): a backward
        # through the same outputs then would keep its gradients local, so it is refused; a gradient from a
        # backward outside forward then stays local too, and is named (engine.reducer.late_gradients).
        self.synced_since_forward = False
        self.local_gradient_warned = False  # that gradient is named once per module
        self._forward_unused: set[int] = set()
        self.start = BackwardStart()  # pre-hooks on the last synchronising forward's outputs
        self.last_exposed_comm_s = 0.0
        self.plan_history: list[tuple[int, list[BucketInfo]]] = []  # (iterations synced before, plan)
        self._start_planning()

    def _set_params(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        sparse_gradients: Sequence[bool] | None,
        used: UsedParameters,
    ) -> None:
        self.params, self.names = list(params), list(names)
        # parameters whose gradients are sparse (embeddings with sparse=True): each in a bucket of its own
        self.sparse_gradients = list(sparse_gradients or [False] * len(self.params))
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self._on_cuda = any(p.device.type == "cuda" for p in self.params)
        self.streams = GradientStreams(self.params)
        # static_graph: the first synchronised backward's record replaces the per-step graph walk
        self.static: StaticGraph | None = StaticGraph(self.names) if self.static_graph else None
        self.used = used  # torch's used maps (engine.used_parameters); read by the optimizer overlap too

    def _start_planning(self) -> None:
        """torch's construction-time buckets, re-planned after the observed ready order; gradient hooks."""
        self.planner = BucketPlanner(
            self.params,
            self.names,
            self.sparse_gradients,
            self.first_cap_bytes,
            self.cap_bytes,
            self.find_unused_parameters,
            self.static_graph,
        )
        self._install_plan(None)
        self._gradient_ready = [self._make_grad_hook(i) for i in range(len(self.params))]
        self._grad_hooks = AccumulatorHooks(self.params, self._gradient_ready.__getitem__)

    def _default_transport(self) -> Transport:
        transport, self.shared_memory_refusal, self._obstacles = choose_default(
            self.process_group, self.params, self.sparse_gradients, self._obstacles
        )
        return transport

    def settle_default(self, obstacles: Sequence[int] | None) -> None:
        """Choose the default path left undecided at construction (:class:`UndecidedDefault
        <lightning_ddpx.engine.transport.transports.UndecidedDefault>`), with every rank's shared-memory
        obstacles (``None``: one all-gather asks). Every rank calls it at the same point, between iterations:
        the module's settings check, whose all-gather carried them, or else the first reduction. Collective
        when both ranks can map shared memory; nothing to do once chosen."""
        old = self.transport
        if not isinstance(old, UndecidedDefault):
            return
        transport, self.shared_memory_refusal, self._obstacles = choose_default(
            self.process_group,
            self.params,
            self.sparse_gradients,
            None if obstacles is None else list(obstacles),
            defer=False,
        )
        transport.set_divisor(old.divisor or self.world_size)  # join's count of ranks stays
        self.use_transport(transport)

    # ----------------------------------------------------------------------------------------- plan
    def _install_plan(self, order: Sequence[int] | None) -> None:
        """Plan buckets along ``order`` (a ready order), or ``None``: the layout before any rebuild."""
        small_last_bucket = self.overlap is not None
        planner = self.planner
        if order is None:
            self.layout = planner.initial_layout(small_last_bucket)
        else:
            self.layout = planner.layout(order, small_last_bucket)
        self.buckets: list[Bucket] = self.layout.buckets
        self._bucket_of, self._position_of = self.layout.bucket_of, self.layout.position_of
        if self.gradient_as_bucket_view:
            self.layout.alias_grads()
        self.transport.set_layout(self.buckets)
        self.plan_history.append((self.iterations_synced, self.layout.infos()))
        self._reset_iteration()

    def bucket_infos(self) -> list[BucketInfo]:
        return self.layout.infos()

    def _reset_iteration(self) -> None:
        count = len(self.buckets)
        self._pending = [len(bucket.params) for bucket in self.buckets]
        self._unused_in_bucket = [0] * count
        self._ready = bytearray(len(self.params))
        self._next_launch = 0
        self._futures: list[torch.futures.Future | None] = [None] * count
        self._launch_streams: list[Any] = [None] * count  # CUDA: the stream each bucket was filled on
        self.stats.begin()
        if self.static is not None:
            self.static.reset()

    def set_static_graph(self) -> None:
        """From the next synchronised backward on, as if built with ``static_graph=True`` (before the first)."""
        self.static_graph = True
        self.planner.allow_rebuild()
        if self.static is None:
            self.static = StaticGraph(self.names)

    # ------------------------------------------------------------------------- between iterations
    def between_iterations(self) -> bool:
        """The one rule for "between iterations": this rank's synchronised backward is not reducing.

        A forward that armed the reducer without its backward having started yet counts as between: no
        bucket is in flight, so the layout, the transport or the parameter set may still change (the next
        synchronising forward arms anew). Every check of the kind asks here, through
        :meth:`require_between_iterations`.
        """
        return self.phase is not Phase.REDUCING

    def require_between_iterations(self, message: str | Callable[[], str]) -> None:
        """Raise ``RuntimeError(message)`` unless :meth:`between_iterations`: buckets of this rank are in
        flight, and the other ranks are reducing them with it, so the iteration must finish as it started."""
        if self.phase is Phase.REDUCING:
            raise RuntimeError(message() if callable(message) else message)

    def synchronising_started(self) -> bool:
        """Whether a synchronising forward armed this reducer or a synchronised backward ran (the static graph
        and other things recorded in the first iteration can no longer be set)."""
        return self.iterations_synced > 0 or self.phase is not Phase.IDLE

    # ------------------------------------------------------------------------------------ transport
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        refuse_dense_only_hook(hook, hook_name(hook), self.names, self.sparse_gradients)
        device = self.params[0].device if self.params else None
        self.use_transport(Transport(hook, state, device))
        self.hook_registered = True

    def use_transport(self, transport: Transport) -> None:
        """Reduce through ``transport`` from now on (every rank alike, between iterations): a registered hook,
        or, in benchmarks, another path to compare. The old transport is closed."""
        self.require_between_iterations(
            "lightning_ddpx: the transport can only change between iterations, not while a backward is "
            "reducing: register the communication hook before training or between steps."
        )
        self.transport.close()
        self.transport = transport
        transport.set_layout(self.buckets)

    # -------------------------------------------------------------------------------------- forward
    def prepare_forward(self, will_sync: bool, rebuild_src: int = 0) -> None:
        """Called before each forward: refuses to start over an unfinished reduction, rebuilds buckets
        (from ``rebuild_src``'s observed order: rank 0's, unless it joined with uneven inputs)."""
        self.synced_since_forward = False
        if self.phase is Phase.REDUCING:
            unlaunched = [b for b, future in enumerate(self._futures) if future is None]
            self._wait_launched_quietly()
            self._end_iteration(succeeded=False)
            raise RuntimeError(messages.unfinished_reduction(unlaunched))
        if will_sync and self.planner.rebuild_pending:
            self._rebuild_buckets(rebuild_src)

    @property
    def shares_used_bitmap(self) -> bool:
        """Whether a synchronised backward now all-reduces the used-parameter bitmap after its buckets."""
        if self.static is not None:
            return self.static.recording
        return self.find_unused_parameters

    def prepare_backward(self, outputs: Any) -> None:
        """Called after a synchronising forward: arm reduction, and find unused parameters if asked.

        The reduction starts when backward reaches ``outputs`` (:mod:`lightning_ddpx.engine.reducer.backward_start`), so
        the end-of-backward callback belongs to the outermost backward, or at the first gradient hook.
        """
        self.phase = Phase.ARMED
        self.forwards_armed += 1
        if self.static is not None:
            self._forward_unused = set(self.static.unused)  # empty while recording: nothing is known yet
        elif self.find_unused_parameters:
            self._forward_unused = unreachable_parameter_indices(outputs, self.index_of)
        self.start.attach(outputs, self._on_backward_start)

    def _on_backward_start(self) -> None:
        """Backward reached forward's outputs: start reducing if it accumulates into the parameters, else only
        claim its end (:mod:`~lightning_ddpx.engine.reducer.backward_start`); refuse a second one after the sync."""
        if self.phase is Phase.IDLE and self.synced_since_forward and self._grad_hooks.any_will_run():
            raise RuntimeError(messages.backward_after_sync(self.rank))  # the outputs kept their pre-hooks
        if self.phase is not Phase.ARMED or self.start.end_claimed:
            return
        if self._grad_hooks.any_will_run():
            self._begin_reduction()
        else:
            self.start.claim_end(lambda: self._finalize() if self.phase is Phase.REDUCING else None)

    def allow_local_backward(self) -> None:
        """``no_sync()`` was entered: backward passes until the next forward accumulate locally, on purpose."""
        self.synced_since_forward = False

    # ------------------------------------------------------------------------------------- backward
    def _make_grad_hook(self, index: int) -> PostHook:
        """Parameter ``index``'s readiness, written in one place: autograd calls this function after each
        accumulation into its ``grad`` (``used`` left ``None``), and :meth:`_mark_ready` calls it for a
        parameter whose gradient is final without a hook (``used`` given): one that backward does not reach,
        or every one at the end of a static graph's recording."""
        reducing, used_here = Phase.REDUCING, self.used.local  # cleared in place: the same map while hooked

        def gradient_ready(_outputs: Any, _inputs: Any, used: bool | None = None) -> None:
            # Runs once per parameter per backward, so it does the minimum: a few list and bytearray stores
            # and one counter decrement; everything per bucket (the batched copy, views, the hook) waits for
            # _launch (copying each gradient here instead, as torch does, measured no faster: docs/benchmarks.md).
            # One function for the hook and the reducer's own marks: a call from the hook to a shared method
            # would cost as much as the rest of it (docs/benchmarks.md, "Per-parameter cost").
            if self.phase is not reducing:  # only autograd's calls come outside a reduction
                if self.phase is Phase.IDLE:
                    self._accumulate_locally(index)
                    return
                self._begin_reduction()
            if self.static is not None and used is None and not self.static.on_gradient(index):
                return  # more gradients of this parameter to come (or recording: all wait for the end)
            ready = self._ready
            if ready[index]:
                raise RuntimeError(messages.ready_twice(self.names[index], self.find_unused_parameters))
            ready[index] = 1
            b = self._bucket_of[index]
            if used is not False:  # None: autograd's call, a gradient arrived
                used_here[index] = 1
                if self._on_cuda:  # its stream noted; with bucket views, copied into its view on that stream
                    bucket = self.buckets[b]
                    as_view = self.gradient_as_bucket_view and not bucket.spec.sparse
                    view = bucket.views[self._position_of[index]] if as_view else None
                    self.streams.note(index, self.params[index], view)
            else:
                self._unused_in_bucket[b] += 1
                if self._on_cuda:  # a gradient kept from earlier backwards is copied on the launch stream
                    self.streams.forget(index)
                if self.gradient_as_bucket_view and not self.buckets[b].spec.sparse:
                    self.buckets[b].detach_unused_view(self._position_of[index])
            if self.planner.recording is not None:  # the first iterations: the ready order a rebuild follows
                self.planner.recording.append(index)
            pending = self._pending
            left = pending[b] - 1
            pending[b] = left
            if not left and b == self._next_launch:
                self._launch_ready_buckets()

        return gradient_ready

    def _accumulate_locally(self, index: int) -> None:
        """A gradient outside a synchronised backward (``no_sync``): averaged at the next synchronisation.

        One that arrives after a synchronised backward and before the next forward (no ``no_sync()``) came
        from a backward outside the module's forward: its bucket is already averaged, so the optimizer would
        use it on this rank only. It is named once (:mod:`~lightning_ddpx.engine.reducer.late_gradients`);
        the check costs a synchronised backward nothing, since its gradients never take this branch.
        """
        if not self._grad_hooks.latest(index):
            return  # a newer wrapper of this parameter reduces it; torch's stale reducers stay quiet too
        self.used.local[index] = 1
        if self.static is not None and self.static.unused_everywhere(index):
            raise RuntimeError(self.static.accumulated_message(index, self.rank))
        if self.synced_since_forward and not self.local_gradient_warned:
            self.local_gradient_warned = True
            warn_local_gradient(self.names[index], self.rank)

    def _begin_reduction(self) -> None:
        self.before_reduction()
        self.settle_default(None)  # the module's settings check chose it; a bare reducer asks here
        self.phase = Phase.REDUCING
        self.transport.begin_reduction()
        if not self.start.end_claimed:  # else the claimed backward's end finalizes
            queue_backward_callback(self._finalize)
        unused, self._forward_unused = self._forward_unused, set()
        for index in sorted(unused):
            self._mark_ready(index, used=False)

    def _mark_ready(self, index: int, used: bool) -> None:
        """Parameter ``index``'s gradient is final without a hook: ``used`` or absent in this backward."""
        self._gradient_ready[index](None, None, used)

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        bucket, transport = self.buckets[b], self.transport
        with label("lightning_ddpx::launch_bucket"):
            stream = current_stream(bucket.buffer.device) if self._on_cuda else None
            self._launch_streams[b] = stream
            local = LocalGradients(
                used=self.used.local,
                all_used=not self._unused_in_bucket[b],
                as_view=self.gradient_as_bucket_view,
                streams=self.streams if self._on_cuda else None,
                stream=stream,
            )
            buffer, views, prefilled = transport.fill(b, bucket, local)
            grad_bucket = GradBucket(
                b,
                buffer,
                bucket.gradients_for_hook(buffer, views),
                bucket.params,
                b == len(self.buckets) - 1,
                self.stats.sent_log,
                names=bucket.names,
            )
            self.progress.record(
                "bucket {} of {} ({}) in iteration {}",
                b,
                len(self.buckets),
                transport.name,
                self.iterations_synced + 1,
            )
            # the timed hook call, as a function and its arguments: no closure per bucket
            call = self.stats.timed(payload_bytes(buffer) if bucket.spec.sparse else bucket.nbytes)
            args: tuple = (transport.reduce, grad_bucket, prefilled)
            if self.progress.debug:  # DDPX_DEBUG: first, every rank checks that it reduces this same bucket
                counters = (self.forwards_armed, self.reductions + 1)
                call = bucket_checked(
                    functools.partial(call, *args), self.process_group, b, bucket.spec, counters
                )
                args = ()
            # the hook runs with ``stream`` current, also on the communication thread (engine.transport.launcher)
            self._futures[b] = transport.launcher.submit(call, *args, stream=stream)

    # ------------------------------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        """End of backward: launch what is left, wait for every bucket, write averaged gradients."""
        succeeded = False
        with label("lightning_ddpx::finalize"):
            try:
                results = ResultsInOrder(self, self._launch_remaining())
                if self.overlap is not None:  # each bucket's parameters step as soon as it is written
                    self.overlap.write_back_and_step(results)
                else:
                    self._write_back_in_order(results)
                    if self.in_backward is not None:  # torch's optimizers in backward, with the average
                        self.in_backward.step_and_release()
                self.last_exposed_comm_s = results.waited
                self.stats.finish(self.iterations_synced + 1, len(self.buckets), results.waited)
                succeeded = True
            except Exception as error:
                if self.usage_log is not None:
                    self.usage_log.record(error)
                raise
            finally:
                self._end_iteration(succeeded)

    def _write_back_in_order(self, results: ResultsInOrder) -> None:
        """Write each bucket back as soon as it arrives, as torch's finalize does, so that the copies of the
        first buckets overlap the later buckets' communication. A bucket holding a parameter this rank did
        not use needs the used-parameter counts (the bitmap, issued after the last bucket) first."""
        for b, result in results:
            counts = results.known_counts if self.bucket_all_used(b) else results.counts()
            self.write_back(b, result, counts)  # a bucket whose parameters all arrived reads no counts
        results.counts()  # every bucket all used here: the bitmap is still checked (and recorded)

    def _launch_remaining(self) -> torch.futures.Future | None:
        """Mark what backward did not reach, so every bucket is launched; returns the used-parameter bitmap's
        future when this iteration shares one. Without ``find_unused_parameters`` a missing gradient fails."""
        ready = self._ready
        missing = [] if ready.find(0) < 0 else [i for i in range(len(ready)) if not ready[i]]
        rank = self.rank
        if self.static is not None:
            if self.static.recording:  # every gradient is complete now: mark all, share which are used
                for index in self.static.recording_order():
                    self._mark_ready(index, used=self.static.fires[index] > 0)
                return self.launch_used_bitmap()
            if missing:  # a parameter short of its recorded count: the graph changed
                self._wait_launched_quietly()
                raise RuntimeError(self.static.missing_message(missing, rank))
            return None
        if missing and not self.find_unused_parameters:
            self._wait_launched_quietly()
            raise RuntimeError(messages.unused_parameters(rank, [self.names[i] for i in missing], missing))
        for index in missing:  # reachable from outputs but not from the loss
            self._mark_ready(index, used=False)
        return self.launch_used_bitmap() if self.find_unused_parameters else None

    def launch_used_bitmap(self) -> torch.futures.Future:
        """Issue the all-reduce of which parameters each rank used since the last synchronisation."""
        device, iteration = self.buckets[0].buffer.device, self.iterations_synced + 1
        return self.used.launch_counts(
            self.process_group, device, self.transport.launcher, self.progress, iteration
        )

    # The interface of the end of backward (engine.results_in_order), the optimizer overlap's included.
    def wait_bucket(self, b: int) -> Any:
        """Bucket ``b``'s reduced result (launched earlier in this backward), checked; on CUDA the current
        stream is ordered after it, without a host synchronisation."""
        future = self._futures[b]
        assert future is not None, f"bucket {b} was never launched"
        bucket = self.buckets[b]
        value = wait_result(
            future, b, bucket, self.transport.name, self.iterations_synced + 1, self.process_group
        )
        # CUDA: wait() made the current stream wait for the future's events (torch's CUDA futures: NCCL's, and
        # the communication thread's, engine.launcher); a future without events (a hook's own) did not, so
        # also wait for the stream the hook ran on.
        if self._on_cuda:
            wait_streams(current_stream(bucket.buffer.device), [self._launch_streams[b]])
        return value

    def recorded_counts(self) -> list[int] | None:
        """Per parameter, how many ranks use it, as a static graph recorded it; ``None``: not recorded."""
        return self.static.globally_used if self.static is not None else None

    def shared_counts(self, globally_used: torch.futures.Future) -> list[int]:
        """Per parameter, how many ranks used it: the used-parameter bitmap's result."""
        return UsedParameters.counts(globally_used, self.process_group, self.static)

    def write_back(self, b: int, result: Any, used_counts: Sequence[int] | None) -> None:
        """Put bucket ``b``'s result into its parameters' ``grad`` (those no rank used keep theirs)."""
        all_used = not self._unused_in_bucket[b]
        self.buckets[b].write_back(result, used_counts, all_used, self.gradient_as_bucket_view)

    def bucket_all_used(self, b: int) -> bool:
        """Whether every parameter of bucket ``b`` received a gradient on this rank in this backward."""
        return not self._unused_in_bucket[b]

    def _end_iteration(self, succeeded: bool) -> None:
        self.phase = Phase.IDLE
        self.reductions += 1
        self.start.iteration_ended(succeeded)
        self.synced_since_forward = succeeded
        self.used.clear()
        if succeeded:
            self.iterations_synced += 1
        self.planner.iteration_ended(succeeded)
        self._reset_iteration()

    def _wait_launched_quietly(self) -> None:
        for future in self._futures:
            if future is not None:
                try:
                    future.wait()
                except Exception:  # noqa: BLE001 - we are already reporting a more useful error
                    pass

    # -------------------------------------------------------------------------------------- rebuild
    def _rebuild_buckets(self, src: int = 0) -> None:
        """Re-plan buckets along the ready order rank ``src`` observed, so all ranks agree on the layout."""
        device = self.buckets[0].buffer.device
        self._install_plan(self.planner.agreed_order(src, self.process_group, device))

    def rebuild_buckets_from(self, src: int) -> None:
        """A joined rank takes part in the active ranks' bucket rebuild (it never rebuilds again)."""
        self._rebuild_buckets(src)
        self.planner.finish_rebuilding()

    def close(self) -> None:
        """Remove the gradient hooks and stop the communication thread; the reducer is unusable after."""
        self._grad_hooks.remove()
        self.start.remove()  # the last outputs' pre-hooks (they stay on until the next forward)
        self.transport.close()
        self.progress.close()
        # Each readiness closure holds this reducer (a cycle): let go of them, so that a closed reducer -- and
        # the process group it holds -- is freed by reference counting, not at the next full collection. A
        # fault-tolerant member's peers wait on that group's connections until they close (fault/generations.py).
        self._gradient_ready = []

    def adopt_params(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        sparse_gradients: Sequence[bool] | None = None,
    ) -> None:
        """Reduce ``params`` from now on: the module's trainable parameters changed (``requires_grad`` flipped
        after wrapping; :mod:`lightning_ddpx.engine.module.trainable_set`). Every rank calls this between iterations
        with the same list. As at construction: gradient hooks on the new list, torch's initial buckets,
        re-planned from the next synchronised backward's gradient order, static_graph recording anew; the
        hook, its state and the overlap stay."""
        self.require_between_iterations(
            "lightning_ddpx: the reduced parameters can only change between iterations"
        )
        self._grad_hooks.remove()
        # "used since the last synchronisation" (no_sync gradients) follows each parameter to its new index
        self._set_params(params, names, sparse_gradients, self.used.carried_over(self.params, params))
        old = self.transport
        if not old.serves(self.params):  # the default path is chosen anew: shared memory may fit now
            old.close()
            self.transport = self._default_transport()
            self.transport.set_divisor(old.divisor or self.world_size)  # join's count of ranks stays
        self._start_planning()

    def set_overlap(self, overlap: Any) -> None:
        """Step the optimizer through ``overlap`` at the end of backward (``None``: the plain step). Switching
        between the two re-plans at once along the current buffer order (between iterations only; a rebuild
        may never come again), since with the overlap the last bucket is planned small."""
        replan = (overlap is None) != (self.overlap is None)
        self.overlap = overlap
        if replan:
            self._install_plan(self.layout.parameter_order() if self.planner.rebuilt else None)

    def order_state(self) -> dict[str, Any]:
        """The bucket layout as plain values: parameter names in buffer order, and whether it was rebuilt."""
        return self.planner.order_state(self.layout)

    def load_order_state(self, state: dict[str, Any]) -> None:
        """Adopt a saved layout now (before the first backward), so a resumed run reduces, and its hooks
        see, exactly the buckets the saved run had. Every rank must load the same state."""
        self.require_between_iterations(
            "lightning_ddpx: a bucket layout can only be loaded between iterations"
        )
        order = self.planner.saved_order(state)  # checked first: the parameters must be the same
        if state.get("rebuilt", True):
            self.planner.finish_rebuilding()
            self._install_plan(order)
        else:
            self._install_plan(None)
