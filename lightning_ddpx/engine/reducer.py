"""The bucketed gradient reducer: gradient hooks, in-order bucket launch, and finalize at end of backward.

An iteration moves through named phases:

- ``IDLE``: no synchronisation expected (``no_sync``, evaluation, or between iterations). Gradient hooks
  return at once and gradients accumulate locally in ``param.grad``.
- ``ARMED``: a synchronising forward ran; the first gradient hook of backward starts reduction.
- ``REDUCING``: backward is running. Each ready gradient is counted in its bucket; a complete bucket is
  launched through the communication hook once every lower-index bucket has been launched. At the end of
  backward the autograd engine calls :meth:`Reducer._finalize`, which waits for the hooks' results and
  writes averaged gradients into ``param.grad``.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx._compat.torch import foreach_copy_, queue_backward_callback
from lightning_ddpx.engine.backward_start import attach_backward_start
from lightning_ddpx.engine.bucketing import BucketInfo, BucketSpec, chunk_ranges, plan_buckets
from lightning_ddpx.engine.comm_stats import CommStatsWindow, StepCommStats
from lightning_ddpx.engine.cuda_streams import current_stream, on_stream, wait_streams
from lightning_ddpx.engine.diagnosis import ProgressBoard, check_same_sequence, dtype_code
from lightning_ddpx.engine.errors import CommunicationError, waiting_for
from lightning_ddpx.engine.grad_bucket import (
    GradBucket,
    collectives_issued_on_call,
    issues_collectives_on_call,
    payload_bytes,
    record_bytes_sent,
)
from lightning_ddpx.engine.graph import reachable_parameter_indices
from lightning_ddpx.engine.launcher import InlineLauncher, SequencedLauncher
from lightning_ddpx.engine.profiling import label
from lightning_ddpx.engine.shared_memory import (
    SharedMemoryExchange,
    gather_obstacles,
    local_obstacles,
    obstacles_refusal,
    open_exchange,
)
from lightning_ddpx.engine.sparse import empty_sparse_like, sparse_refusal
from lightning_ddpx.engine.static_graph import StaticGraph
from lightning_ddpx.engine.usage_log import UsageLog

__all__ = ["Reducer"]

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


@collectives_issued_on_call
def _sum_allreduce_hook(process_group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
    """The default path's hook: gradients were already scaled by 1/world_size while copied into the bucket."""
    buffer = bucket.buffer()
    record_bytes_sent(bucket, payload_bytes(buffer))
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future()


# Two ranks on the CPU: a bucket this large or larger is reduced as two all-reduces of its halves, issued
# together. gloo runs concurrent collectives on its worker threads (two per process group by default), so
# the halves travel in parallel: faster than one all-reduce from 4 MB on, not at 1-2 MB (figures:
# docs/benchmarks.md, "Large buckets in halves"; benchmarks/bench_collectives.py).
_HALVES_MIN_BYTES = 4 * 1024 * 1024


@collectives_issued_on_call
def _sum_allreduce_in_halves(process_group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
    """The default path's hook for a large bucket between two CPU ranks: one sum-allreduce per half. With two
    ranks each element is ``a + b`` whichever collective carries it, so the result is bit-identical to one
    all-reduce (with more ranks gloo's ring would sum in a different order: not used there)."""
    buffer = bucket.buffer()
    record_bytes_sent(bucket, payload_bytes(buffer))
    futures = [
        dist.all_reduce(half, group=process_group, async_op=True).get_future()
        for half in buffer.tensor_split(2)
    ]
    return torch.futures.collect_all(futures).then(lambda _: buffer)


# With no hook, scaling happens during the copy into the bucket (one pass over the gradients instead of a copy
# and a multiply, as torch's reducer does). Per-parameter fused multiplies cost one dispatch each, so buckets
# of many small tensors copy in one batched call and scale the whole buffer instead.
_FUSED_SCALE_MIN_AVERAGE_NUMEL = 16384


class Phase(enum.Enum):
    IDLE = "idle"
    ARMED = "armed"
    REDUCING = "reducing"


def _param_views(
    flat: torch.Tensor, spec: BucketSpec, params: Sequence[torch.nn.Parameter]
) -> list[torch.Tensor]:
    """Views into ``flat`` (laid out like bucket ``spec``), one per parameter, shaped like it."""
    return [flat[offset : offset + p.numel()].view_as(p) for offset, p in zip(spec.offsets, params)]


class _Bucket:
    """Runtime storage for one :class:`BucketSpec`: the flat buffer and per-parameter views into it."""

    __slots__ = ("spec", "buffer", "views", "params", "nbytes", "names", "fused_scale", "slot_views")

    def __init__(self, spec: BucketSpec, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        self.spec = spec
        self.names = tuple(names[i] for i in spec.param_indices)
        self.params = [params[i] for i in spec.param_indices]
        # A sparse gradient is reduced as it is (lightning_ddpx.engine.sparse): no flat buffer, no views.
        self.buffer = torch.zeros(0 if spec.sparse else spec.numel, dtype=spec.dtype, device=spec.device)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.views = [] if spec.sparse else _param_views(self.buffer, spec, self.params)
        # Large gradients on average: scale while copying, one fused multiply per parameter (see above).
        self.fused_scale = spec.numel >= _FUSED_SCALE_MIN_AVERAGE_NUMEL * len(self.params)
        # two CPU ranks, shared memory: per generation, this rank's slot and views into it like ``views``
        self.slot_views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}


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
        self.params = list(params)
        self.usage_log = usage_log  # records the errors backward raises (torch's usage logger)
        # parameters whose gradients are sparse (embeddings with sparse=True): each in a bucket of its own
        self.sparse_gradients = list(sparse_gradients or [False] * len(self.params))
        self.names = list(names)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.first_cap_bytes = first_cap_bytes
        self.cap_bytes = cap_bytes
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        # static_graph: the first synchronised backward's record replaces the per-step graph walk
        self.static: StaticGraph | None = StaticGraph(self.names) if static_graph else None
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        # CUDA: the stream that produced each parameter's gradient (lightning_ddpx.engine.cuda_streams)
        self._on_cuda = any(p.device.type == "cuda" for p in self.params)
        self._grad_streams: list[Any] = [None] * len(self.params)

        self.hook: CommHook = _sum_allreduce_hook
        self.hook_state: Any = process_group
        self._hook_name = _hook_name(self.hook)  # for progress records and errors
        self._scale_on_copy: float | None = 1.0 / self.world_size  # only for the default hook
        self._divisor = self.world_size  # ... and for sparse gradients, divided as torch's reducer does
        self._launcher: InlineLauncher | SequencedLauncher = InlineLauncher()
        # overlap_optimizer_with: writes back and steps bucket by bucket in _finalize (engine.optimizer_overlap)
        self.overlap: Any = None  # set through set_overlap: the bucket plan depends on it
        # With the overlap, reduce the last bucket in chunks (off only to measure what that gains; set it
        # alike on every rank, as the collectives differ)
        self.chunk_last_bucket = True
        # Two CPU ranks, default path: reduce large buckets as two halves (off only to measure what that gains;
        # set it alike on every rank, as the collectives differ)
        self.split_large_buckets = True
        # Two CPU ranks on one machine, default path: sum buckets through shared memory instead of gloo's
        # loopback (lightning_ddpx.engine.shared_memory); off only to measure what that gains (set it alike on
        # every rank: the collectives differ). Every rank's local_obstacles, when a collective at construction
        # already carried them (the module's model check); None: the set-up gathers them itself.
        self._shared_memory_obstacles = (
            None if shared_memory_obstacles is None else list(shared_memory_obstacles)
        )
        exchange, refusal = self._open_shared_memory()
        self.shared_memory: SharedMemoryExchange | None = exchange
        self.shared_memory_refusal: str | None = refusal  # why not, when shared memory is not set up
        self.use_shared_memory = True
        # and copy gradients straight into this rank's slot (off only to measure what that gains)
        self.fill_slots_directly = True

        self.phase = Phase.IDLE
        self.iterations_synced = 0  # completed synchronised backwards
        self._ready_order: list[int] | None = []  # recorded in the first synchronised backward
        self._rebuild_pending = False
        # True from the end of a synchronised backward until the next forward (or no_sync()): a gradient
        # arriving then comes from a second backward of the same forward, which would stay local.
        self._synced_since_forward = False
        self._forward_unused: set[int] = set()
        self._start_hooks: list[Any] = []  # pre-hooks on the last synchronising forward's output nodes
        self._observed_order: list[int] = []
        self.last_exposed_comm_s = 0.0
        self.last_step_stats: StepCommStats | None = None
        self.collect_stats = True  # off only to measure what collecting costs (benchmarks/bench_stats.py)
        self.stats_window = CommStatsWindow()
        self.plan_history: list[tuple[int, list[BucketInfo]]] = []  # (iterations synced before, plan)
        self.progress = ProgressBoard(process_group)  # what this rank last started, for hang reports
        # Synchronising forwards and reductions so far, shadowed ones (join) included: DDPX_DEBUG compares them.
        self._forwards_armed = 0
        self._reductions = 0
        # Parameters that received a gradient on this rank since the last synchronised backward, no_sync()
        # backwards included (torch's local_used_map): the bitmap find_unused_parameters shares, so that a
        # gradient accumulated only in a no_sync() micro-batch is still averaged. Reset after each
        # synchronised backward only; indexed by parameter, so bucket rebuilds keep it.
        self._locally_used = bytearray(len(self.params))
        self._install_plan(list(reversed(range(len(self.params)))))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_grad_hook(i)) for i, p in enumerate(self.params)
        ]

    # ----------------------------------------------------------------------------------------- plan
    def _install_plan(self, order: Sequence[int]) -> None:
        numels = [p.numel() for p in self.params]
        specs = plan_buckets(
            numels, [p.dtype for p in self.params], [p.device for p in self.params], order,
            self.first_cap_bytes, self.cap_bytes,
            # the overlap cannot hide the last bucket's update: keep that bucket small (plan_buckets)
            self.first_cap_bytes if self.overlap is not None else None,
            self.sparse_gradients if any(self.sparse_gradients) else None,
        )  # fmt: skip
        self.buckets = [_Bucket(spec, self.params, self.names) for spec in specs]
        self._last_bucket_chunks = self._plan_last_bucket_chunks()
        self._bucket_of = [0] * len(self.params)
        self._position_of = [0] * len(self.params)
        for b, bucket in enumerate(self.buckets):
            for position, index in enumerate(bucket.spec.param_indices):
                self._bucket_of[index] = b
                self._position_of[index] = position
        if self.gradient_as_bucket_view:
            self._alias_grads_to_buckets()
        if self.shared_memory is not None:
            self.shared_memory.set_layout([bucket.nbytes for bucket in self.buckets])
        self.plan_history.append((self.iterations_synced, self.bucket_infos()))
        self._reset_iteration()

    def _open_shared_memory(self) -> tuple[SharedMemoryExchange | None, str | None]:
        """Two gloo ranks with CPU parameters: map the shared-memory slots (none on every rank when any rank
        cannot take part). Returns the exchange, or why not.

        No collective when every rank knows alike that shared memory is out (world size, backend) or when
        the ranks' obstacles, already gathered, rule it out (``DDPX_SHARED_MEMORY=0`` on any rank...);
        otherwise collective (:mod:`lightning_ddpx.engine.shared_memory`, "Set-up")."""
        backend = dist.get_backend(self.process_group)
        if self.world_size != 2:
            return (
                None,
                f"{self.world_size} ranks: shared memory serves two (more would not sum like gloo's ring)",
            )
        if backend != "gloo":
            return None, f"backend {backend!r} rather than gloo"
        if self._shared_memory_obstacles is None:  # built without the model check that carries them
            on_cpu = all(p.device.type == "cpu" for p in self.params)
            with waiting_for("the other rank to say whether it can use shared memory", self.process_group):
                self._shared_memory_obstacles = gather_obstacles(self.process_group, local_obstacles(on_cpu))
        refusal = obstacles_refusal(self._shared_memory_obstacles, dist.get_rank(self.process_group))
        if refusal is not None:
            return None, refusal
        sizes = [
            0 if sparse else p.numel() * p.element_size()
            for p, sparse in zip(self.params, self.sparse_gradients)
        ]
        with waiting_for("the other rank to map the shared-memory slots", self.process_group):
            return open_exchange(self.process_group, sizes)

    def _plan_last_bucket_chunks(self) -> list[tuple[int, int]] | None:
        """With the overlap, on the CPU: the element ranges in which the default path reduces the last
        bucket, one collective each, so that its update can start before all of it is reduced (see
        :mod:`lightning_ddpx.engine.piecewise_step`); ``None`` to reduce it in one piece."""
        if self.overlap is None or self._on_cuda or not self.buckets or self.buckets[-1].spec.sparse:
            return None  # CUDA: not measured (no GPU here), so not enabled
        spec = self.buckets[-1].spec
        numels = [self.params[i].numel() for i in spec.param_indices]
        ranges = chunk_ranges(spec.offsets, numels, self.slice_numel(spec.dtype))
        return ranges if len(ranges) > 1 else None

    def slice_numel(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` in the first bucket's cap: the size of the last bucket's chunks under the
        overlap, and of the slices it updates large parameters in (1 MiB by default: see
        :mod:`lightning_ddpx.engine.piecewise_step` for why slices are faster)."""
        return max(1, self.first_cap_bytes // dtype.itemsize)  # asked per parameter per step: no tensor made

    @torch.no_grad()
    def _alias_grads_to_buckets(self) -> None:
        """Make every existing ``param.grad`` a view into its bucket (values kept)."""
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not None and param.grad is not view:
                    view.copy_(param.grad)
                    param.grad = view

    def bucket_infos(self) -> list[BucketInfo]:
        return [
            BucketInfo(b, bucket.spec.num_bytes, bucket.spec.dtype, bucket.spec.device,
                       tuple(self.names[i] for i in bucket.spec.param_indices))
            for b, bucket in enumerate(self.buckets)
        ]  # fmt: skip

    def _reset_iteration(self) -> None:
        count = len(self.buckets)
        self._pending = [len(bucket.params) for bucket in self.buckets]
        self._unused_in_bucket = [0] * count
        self._ready = bytearray(len(self.params))
        self._next_launch = 0
        self._futures: list[torch.futures.Future | None] = [None] * count
        # (start, end, future) of each collective when the last bucket is reduced in chunks
        self._last_bucket_reductions: list[tuple[int, int, torch.futures.Future]] = []
        self._launch_streams: list[Any] = [None] * count  # CUDA: the stream each bucket was filled on
        # Statistics of this iteration; the lists are appended to from the hooks' threads (atomic).
        self._bytes_to_hook = 0
        self._sent_log: list[int] = []
        self._hook_seconds: list[float] = []
        if self.static is not None:
            self.static.reset()

    def set_static_graph(self) -> None:
        """From the next synchronised backward on, as if built with ``static_graph=True`` (before the first)."""
        self.static_graph = True
        if self.static is None:
            self.static = StaticGraph(self.names)

    # ------------------------------------------------------------------------------------ comm hook
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        self._refuse_dense_only_hook(hook)
        self.hook, self.hook_state = hook, state
        self._hook_name = _hook_name(hook)
        self._scale_on_copy = None  # a registered hook sees the plain local gradients
        self._launcher.close()
        # CUDA: the communication thread's futures carry events on the buckets' device (engine.launcher)
        device = self.params[0].device if self.params else None
        self._launcher = (
            InlineLauncher() if issues_collectives_on_call(hook) else SequencedLauncher(device=device)
        )

    # -------------------------------------------------------------------------------------- forward
    def prepare_forward(self, will_sync: bool, rebuild_src: int = 0) -> None:
        """Called before each forward: refuses to start over an unfinished reduction, rebuilds buckets
        (from ``rebuild_src``'s observed order: rank 0's, unless it joined with uneven inputs)."""
        self._synced_since_forward = False
        if self.phase is Phase.REDUCING:
            self._abandon_iteration()
            raise RuntimeError(
                "lightning_ddpx: the previous backward started synchronising gradients but never finished "
                f"(buckets not launched: {self._unlaunched()}). This happens when backward raised or was "
                "interrupted. Ranks may now be out of step; restart from a checkpoint."
            )
        if will_sync and self._rebuild_pending:
            self._rebuild_buckets(rebuild_src)

    @property
    def has_rebuilt_buckets(self) -> bool:
        """The buckets follow the observed gradient order now (torch: rebuilt after the first iteration)."""
        return self._ready_order is None and not self._rebuild_pending

    @property
    def rebuild_pending(self) -> bool:
        """Buckets will be re-planned at the next synchronising forward (after the first backward)."""
        return self._rebuild_pending

    def _refuse_dense_only_hook(self, hook: CommHook) -> None:
        sparse = [name for name, flag in zip(self.names, self.sparse_gradients) if flag]
        refusal = sparse_refusal(hook) if sparse else None
        if refusal is not None:
            raise ValueError(
                f"lightning_ddpx: the communication hook {_hook_name(hook)} cannot reduce sparse gradients "
                f"({refusal}), and parameter(s) {sparse} produce them (nn.Embedding/nn.EmbeddingBag with "
                "sparse=True). Register no hook (the default averages sparse gradients with a sparse "
                "all-reduce) or the allreduce hook, or build those layers with sparse=False."
            )

    def set_divisor(self, count: int) -> None:
        """Average over ``count`` ranks from now on (default path only: a registered hook divides itself).

        ``join(divide_by_initial_world_size=False)`` sets the number of ranks still training, as torch does.
        """
        if self._scale_on_copy is not None:
            self._scale_on_copy = 1.0 / count
            self._divisor = count

    # ----------------------------------------------------------------------------------- uneven inputs
    def rebuild_buckets_from(self, src: int) -> None:
        """A joined rank takes part in the active ranks' bucket rebuild (it never rebuilds again)."""
        self._rebuild_buckets(src)
        self._ready_order = None

    @property
    def shares_used_bitmap(self) -> bool:
        """Whether a synchronised backward now all-reduces the used-parameter bitmap after its buckets."""
        if self.static is not None:
            return self.static.recording
        return self.find_unused_parameters

    def shadow_reduction(self, bitmap: bool) -> None:
        """Reduce one iteration with zero gradients, as a rank that has joined (see :mod:`lightning_ddpx.engine.join`).

        Every bucket goes through the registered hook, in bucket order, exactly like a real backward, then
        the used-parameter bitmap (all zeros) when the active ranks share theirs (``bitmap``); results are
        discarded.
        """
        if self.phase is not Phase.IDLE:
            raise RuntimeError(
                "lightning_ddpx: a joined rank cannot shadow while its own backward is reducing"
            )
        state = self.hook_state
        launched: list[tuple[int, torch.futures.Future]] = []
        if self.shared_memory is not None:
            self.shared_memory.next_generation()  # as the active ranks do when their backward starts
        with label("lightning_ddpx::join_shadow"):
            for b, bucket in enumerate(self.buckets):
                if bucket.spec.sparse:
                    zeros, views = empty_sparse_like(bucket.params[0]), []
                else:
                    zeros = torch.zeros_like(bucket.buffer)
                    views = _param_views(zeros, bucket.spec, bucket.params)
                grad_bucket = GradBucket(
                    b, zeros, views, bucket.params, b == len(self.buckets) - 1, names=bucket.names
                )
                self.progress.record(
                    "bucket {} of {} ({}), shadowing (joined)", b, len(self.buckets), self._hook_name
                )
                hook = self._hook_for(b)  # the active ranks' collectives (the last bucket's chunks included)
                call: Callable[[], torch.futures.Future] = lambda gb=grad_bucket, hook=hook: hook(state, gb)  # noqa: E731
                call = on_stream(current_stream(zeros.device), call)  # CUDA: after the zeros were written
                if self.progress.debug:  # counted as if this rank ran the forward it shadows
                    call = self._checked(call, b, (self._forwards_armed + 1, self._reductions + 1))
                launched.append((b, self._launcher.submit(call)))
            used = self._launch_used_bitmap() if bitmap else None
            for b, future in launched:
                what = f"bucket {b} (parameters {self._bucket_names(b)}), shadowed with zeros by this joined rank"
                with waiting_for(what, self.process_group):
                    future.wait()
            if used is not None:
                with waiting_for(
                    "the used-parameter bitmap, shadowed by this joined rank", self.process_group
                ):
                    used.wait()
        self._forwards_armed += 1
        self._reductions += 1

    def prepare_backward(self, outputs: Any) -> None:
        """Called after a synchronising forward: arm reduction, and find unused parameters if asked.

        The reduction starts when backward reaches ``outputs`` (:mod:`lightning_ddpx.engine.backward_start`), so
        the end-of-backward callback belongs to the outermost backward, or at the first gradient hook.
        """
        self.phase = Phase.ARMED
        self._forwards_armed += 1
        if self.static is not None:
            self._forward_unused = set(self.static.unused)  # empty while recording: nothing is known yet
        elif self.find_unused_parameters:
            reached = reachable_parameter_indices(outputs, self._index_of)
            self._forward_unused = set(range(len(self.params))) - reached
        self._remove_start_hooks()
        self._start_hooks = attach_backward_start(outputs, self._on_backward_start)

    def _remove_start_hooks(self) -> None:
        for handle in self._start_hooks:
            handle.remove()
        self._start_hooks = []

    def _on_backward_start(self) -> None:
        """Backward reached forward's outputs (before any gradient of forward's parameters)."""
        if self.phase is Phase.ARMED:
            self._begin_reduction()

    def allow_local_backward(self) -> None:
        """``no_sync()`` was entered: backward passes until the next forward accumulate locally, on purpose."""
        self._synced_since_forward = False

    def disarm(self) -> None:
        """A forward that will not synchronise (``no_sync`` or grad disabled) cancels a pending one."""
        if self.phase is Phase.ARMED:
            self.phase = Phase.IDLE

    # ------------------------------------------------------------------------------------- backward
    def _make_grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        reducing, idle = Phase.REDUCING, Phase.IDLE

        def on_grad_accumulated(_param: torch.Tensor) -> None:
            # Runs once per parameter per backward, so it does the minimum: a few list and bytearray stores
            # and one counter decrement; everything per bucket (copies, views, the hook) waits for _launch.
            if self.phase is not reducing:
                if self.phase is idle:
                    if self._synced_since_forward:
                        raise RuntimeError(self._backward_after_sync_message(index))
                    self._locally_used[index] = 1  # accumulating (no_sync): averaged at the next sync
                    if self.static is not None and self.static.unused_everywhere(index):
                        raise RuntimeError(
                            self.static.accumulated_message(index, dist.get_rank(self.process_group))
                        )
                    return
                self._begin_reduction()
            if self.static is not None and not self.static.on_gradient(index):
                return  # more gradients of this parameter to come (or recording: all wait for the end)
            # _mark_ready(index, used=True), inlined: a call costs as much as the rest of this function
            ready = self._ready
            if ready[index] or self._ready_order is not None or self._on_cuda:
                self._mark_ready(index, used=True)  # errors, the first iterations, CUDA: the general path
                return
            ready[index] = 1
            self._locally_used[index] = 1
            b = self._bucket_of[index]
            pending = self._pending
            left = pending[b] - 1
            pending[b] = left
            if not left and b == self._next_launch:
                self._launch_ready_buckets()

        return on_grad_accumulated

    def _begin_reduction(self) -> None:
        self.phase = Phase.REDUCING
        if self.shared_memory is not None:
            self.shared_memory.next_generation()  # every reduction, so that it stays in step with the other rank
        queue_backward_callback(self._finalize)
        unused, self._forward_unused = self._forward_unused, set()
        for index in sorted(unused):
            self._mark_ready(index, used=False)

    def _mark_ready(self, index: int, used: bool) -> None:
        ready = self._ready
        if ready[index]:
            raise RuntimeError(self._ready_twice_message(index))
        ready[index] = 1
        if self._ready_order is not None:
            self._ready_order.append(index)
        b = self._bucket_of[index]
        if used:
            self._locally_used[index] = 1
            if self._on_cuda:
                self._note_cuda_gradient(index, b)
        else:
            self._unused_in_bucket[b] += 1
            if self._on_cuda:  # a gradient kept from earlier backwards is copied on the launch stream
                self._grad_streams[index] = None
            if self.gradient_as_bucket_view and not self.buckets[b].spec.sparse:
                self._detach_unused_view(index, b)
        pending = self._pending
        left = pending[b] - 1
        pending[b] = left
        if not left and b == self._next_launch:
            self._launch_ready_buckets()

    def _note_cuda_gradient(self, index: int, b: int) -> None:
        """CUDA: remember the stream that produced the gradient; with bucket views, copy it into its view on
        that stream now (the tensor autograd made is freed right after, so the copy must not outlive it on
        another stream). On the CPU, views adopt their gradients in one batched copy at launch instead."""
        self._grad_streams[index] = torch.cuda.current_stream(self.params[index].device)
        if self.gradient_as_bucket_view and not self.buckets[b].spec.sparse:
            param = self.params[index]
            view = self.buckets[b].views[self._position_of[index]]
            if param.grad is not view:
                with torch.no_grad():
                    view.copy_(param.grad)
                param.grad = view

    @torch.no_grad()
    def _adopt_grads_as_views(self, b: int, bucket: _Bucket) -> None:
        """gradient_as_bucket_view: make each used parameter's ``grad`` its bucket view, copying the values of
        gradients autograd allocated itself (after ``zero_grad(set_to_none=True)``) in one batched copy."""
        params, views = bucket.params, bucket.views
        grads = [param.grad for param in params]
        if self._unused_in_bucket[b]:  # unused parameters' views were detached (zeroed) already
            used, indices = self._locally_used, bucket.spec.param_indices
            stale = [k for k, grad in enumerate(grads) if grad is not views[k] and used[indices[k]]]
        else:
            stale = [k for k, grad in enumerate(grads) if grad is not views[k]]
        if not stale:
            return  # gradients kept between steps (zero_grad(set_to_none=False)) were accumulated in place
        if len(stale) < len(grads):
            params, views, grads = ([items[k] for k in stale] for items in (params, views, grads))
        try:
            foreach_copy_(views, grads)
        except RuntimeError:
            self._refuse_unexpected_sparse(bucket)
            raise
        for param, view in zip(params, views):
            param.grad = view

    def _detach_unused_view(self, index: int, b: int) -> None:
        """A parameter this backward did not reach contributes the gradient it holds (accumulated in
        ``no_sync()`` micro-batches, or kept from earlier steps), or zero if it holds none, as in torch.
        Its own ``grad`` becomes a private copy until the end of backward, so that it keeps its value if
        no rank used the parameter (see :meth:`_write_back_bucket`)."""
        param = self.params[index]
        view = self.buckets[b].views[self._position_of[index]]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad is view:
            param.grad = view.clone()
        else:
            view.copy_(grad)

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        with label("lightning_ddpx::launch_bucket"):
            stream = current_stream(bucket.buffer.device)  # None off CUDA
            others = self._other_producing_streams(bucket, stream)
            self._launch_streams[b] = stream
            hook = self._hook_for(b)
            buffer, views, nbytes = bucket.buffer, bucket.views, bucket.nbytes
            if bucket.spec.sparse:
                wait_streams(stream, others)
                buffer, views = self._sparse_contribution(bucket), []
                nbytes = payload_bytes(buffer)
            elif not self.gradient_as_bucket_view:
                if others:
                    self._copy_on_producing_streams(b, bucket, self._scale_on_copy, stream)
                elif (
                    self.fill_slots_directly
                    and self.shared_memory is not None
                    and hook == self.shared_memory.sum_hook
                ):
                    # straight into this rank's slot: one copy less
                    self._copy_grads_into(b, bucket, self._scale_on_copy, self._own_slot_views(bucket, b))
                    hook = self.shared_memory.sum_filled_hook
                else:
                    self._copy_grads_into(b, bucket, self._scale_on_copy)
            else:
                wait_streams(stream, others)  # CUDA: the views were written in each gradient's own hook
                self._adopt_grads_as_views(b, bucket)
                if self._scale_on_copy is not None:
                    bucket.buffer.mul_(self._scale_on_copy)
            sent_log = self._sent_log if self.collect_stats else None
            grad_bucket = GradBucket(
                b, buffer, views, bucket.params, b == len(self.buckets) - 1, sent_log, names=bucket.names
            )  # fmt: skip
            self.progress.record(
                "bucket {} of {} ({}) in iteration {}", b, len(self.buckets), self._hook_name,
                self.iterations_synced + 1,
            )  # fmt: skip
            call = on_stream(stream, self._hook_call(hook, grad_bucket, nbytes))  # also on comm thread
            if self.progress.debug:
                call = self._checked(call, b, (self._forwards_armed, self._reductions + 1))
            self._futures[b] = self._launcher.submit(call)

    def _sparse_contribution(self, bucket: _Bucket) -> torch.Tensor:
        """What this rank hands the hook for a sparse bucket: the gradient itself, as torch does (divided by
        the world size on the default path, into a new tensor), an empty one if it holds none, or a copy
        if it was kept from earlier steps (so that it stays untouched if no rank used the parameter)."""
        index, param = bucket.spec.param_indices[0], bucket.params[0]
        grad = param.grad
        if grad is None:
            contribution = empty_sparse_like(param)
        elif not grad.is_sparse:
            raise RuntimeError(
                f"lightning_ddpx: parameter {self.names[index]!r} belongs to an embedding built with "
                f"sparse=True, so it was given a sparse bucket, but its gradient is {grad.layout}. Set the "
                "layer's sparse flag before wrapping the module and leave it unchanged afterwards."
            )
        else:
            contribution = grad if self._locally_used[index] else grad.clone()
        if self._scale_on_copy is not None:
            contribution = contribution.div(self._divisor)
        return contribution

    def _checked(
        self, call: Callable[[], torch.futures.Future], b: int, counters: tuple[int, int]
    ) -> Callable[[], torch.futures.Future]:
        """``call`` preceded by DDPX_DEBUG's check that every rank reduces this same bucket now."""
        spec = self.buckets[b].spec
        signature = (*counters, b, spec.numel, dtype_code(spec.dtype))
        group, device = self.process_group, self.buckets[b].buffer.device

        def checked() -> torch.futures.Future:
            check_same_sequence(group, device, signature, f"bucket {b} before its hook")
            return call()

        return checked

    def _other_producing_streams(self, bucket: _Bucket, stream: Any) -> list[Any]:
        """CUDA: streams other than ``stream`` that produced gradients of this bucket (usually none)."""
        if stream is None:
            return []
        streams = self._grad_streams  # None for parameters this backward did not reach
        return [
            streams[i] for i in bucket.spec.param_indices if streams[i] is not None and streams[i] != stream
        ]

    @torch.no_grad()
    def _copy_on_producing_streams(self, b: int, bucket: _Bucket, scale: float | None, stream: Any) -> None:
        """CUDA, gradients from several streams: copy each on the stream that produced it, then make the
        launch stream wait for those streams (GPU events, no host synchronisation)."""
        producers = []
        for index, param, view in zip(bucket.spec.param_indices, bucket.params, bucket.views):
            if param.grad is None:
                view.zero_()
                continue
            producer = self._grad_streams[index]
            producers.append(producer)
            with torch.cuda.stream(producer):
                if scale is None:
                    view.copy_(param.grad)
                else:
                    torch.mul(param.grad, scale, out=view)
        wait_streams(stream, producers)

    def _hook_for(self, b: int) -> CommHook:
        """The hook that reduces bucket ``b``: the registered one, or the default path's (in chunks for the
        last bucket under the overlap)."""
        if self.buckets[b].spec.sparse:
            return self.hook  # the default: a sparse sum-allreduce of the pre-divided gradient
        if b == len(self.buckets) - 1 and self.reduces_last_bucket_in_chunks:
            return self._sum_allreduce_in_chunks
        if self.shared_memory is not None and self.reduces_through_shared_memory:
            return self.shared_memory.sum_hook
        if self.reduces_in_halves(b):
            return _sum_allreduce_in_halves
        return self.hook

    def _own_slot_views(self, bucket: _Bucket, b: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's shared-memory slot for bucket ``b`` in this reduction, and views into it shaped like
        the bucket's parameters (made once per generation: a view costs about as much as copying 4 KB)."""
        exchange = self.shared_memory
        assert exchange is not None
        cached = bucket.slot_views.get(exchange.generation)
        if cached is None:
            slot = exchange.own_slot(b, bucket.buffer)
            cached = bucket.slot_views[exchange.generation] = (
                slot,
                _param_views(slot, bucket.spec, bucket.params),
            )
        return cached

    @property
    def reduces_through_shared_memory(self) -> bool:
        """Whether buckets (but the last one under the overlap, in chunks) are summed through shared memory
        (default path, two CPU ranks on one machine: :mod:`lightning_ddpx.engine.shared_memory`)."""
        return self.shared_memory is not None and self.use_shared_memory and self.hook is _sum_allreduce_hook

    def reduces_in_halves(self, b: int) -> bool:
        """Whether bucket ``b`` goes out as two all-reduces of its halves (default path, two CPU ranks not
        using shared memory, at least ``_HALVES_MIN_BYTES``: see :func:`_sum_allreduce_in_halves`)."""
        return (
            self.split_large_buckets
            and not self.reduces_through_shared_memory
            and self.hook is _sum_allreduce_hook
            and self.world_size == 2
            and not self._on_cuda
            and self.buckets[b].nbytes >= _HALVES_MIN_BYTES
        )

    @property
    def reduces_last_bucket_in_chunks(self) -> bool:
        """Whether the last bucket goes out as several collectives (the overlap, the default path, CPU)."""
        return (
            self._last_bucket_chunks is not None
            and self.chunk_last_bucket
            and self.hook is _sum_allreduce_hook
        )

    @property
    def last_bucket_collectives(self) -> int:
        """How many collectives reduce the last bucket: its chunks' (:attr:`reduces_last_bucket_in_chunks`),
        2 (:meth:`reduces_in_halves`) or 1."""
        if self.reduces_last_bucket_in_chunks:
            return len(self._last_bucket_chunks or ())
        return 2 if self.reduces_in_halves(len(self.buckets) - 1) else 1

    def _sum_allreduce_in_chunks(
        self, process_group: dist.ProcessGroup, bucket: GradBucket
    ) -> torch.futures.Future:
        """The default path's hook for the last bucket under the overlap: one sum-allreduce per chunk, all
        issued now (gloo runs them in order), each chunk's future kept for :meth:`reduced_chunks_of_last`."""
        buffer = bucket.buffer()
        record_bytes_sent(bucket, payload_bytes(buffer))
        assert self._last_bucket_chunks is not None
        self._last_bucket_reductions = [
            (start, end, dist.all_reduce(buffer[start:end], group=process_group, async_op=True).get_future())
            for start, end in self._last_bucket_chunks
        ]
        return torch.futures.collect_all([future for _, _, future in self._last_bucket_reductions]).then(
            lambda _: buffer
        )

    def reduced_chunks_of_last(self) -> Iterator[tuple[int, int, float]]:
        """Yield ``(start, end, seconds waited)`` for each chunk of the last bucket as its reduction
        completes, in order (only when it was launched in chunks: :attr:`reduces_last_bucket_in_chunks`)."""
        b = len(self.buckets) - 1
        for start, end, future in self._last_bucket_reductions:
            started = time.perf_counter()
            what = lambda start=start, end=end: (  # noqa: E731 - built only if the wait fails
                f"elements {start}:{end} of bucket {b} (parameters {self._bucket_names(b)}) of iteration "
                f"{self.iterations_synced + 1} to be reduced"
            )
            with waiting_for(what, self.process_group):
                future.wait()
            yield start, end, time.perf_counter() - started
        self._result_of(b)  # completed by now: its checks, and the stream order on CUDA

    def _hook_call(
        self, hook: CommHook, grad_bucket: GradBucket, nbytes: int
    ) -> Callable[[], torch.futures.Future]:
        """The hook's call on one bucket, timed into this iteration's statistics when they are kept."""
        state = self.hook_state
        if not self.collect_stats:
            return lambda: hook(state, grad_bucket)
        self._bytes_to_hook += nbytes
        hook_seconds = self._hook_seconds  # this iteration's list, wherever (whichever thread) the call runs

        def call_hook() -> torch.futures.Future:
            started = time.perf_counter()
            try:
                with label("lightning_ddpx::comm_hook"):
                    return hook(state, grad_bucket)
            finally:
                hook_seconds.append(time.perf_counter() - started)

        return call_hook

    @torch.no_grad()
    def _copy_grads_into(
        self,
        b: int,
        bucket: _Bucket,
        scale: float | None,
        target: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> None:
        """Fill the bucket (or ``target``: a flat buffer laid out like it, and its per-parameter views) from
        ``param.grad`` (zero for parameters holding none), times ``scale`` if given."""
        buffer, views = target if target is not None else (bucket.buffer, bucket.views)
        fused = scale is not None and bucket.fused_scale
        try:
            if self._unused_in_bucket[b] == 0 and not fused:
                foreach_copy_(views, [p.grad for p in bucket.params])
                if scale is not None:
                    buffer.mul_(scale)
                return
            for param, view in zip(bucket.params, views):
                if param.grad is None:
                    view.zero_()
                elif scale is None:
                    view.copy_(param.grad)
                else:
                    torch.mul(param.grad, scale, out=view)
        except RuntimeError:
            self._refuse_unexpected_sparse(bucket)
            raise

    def _refuse_unexpected_sparse(self, bucket: _Bucket) -> None:
        """A copy into a dense bucket failed: name the parameters whose gradient is sparse, if any."""
        sparse = [
            name for name, p in zip(bucket.names, bucket.params) if p.grad is not None and p.grad.is_sparse
        ]
        if sparse:
            raise RuntimeError(
                f"lightning_ddpx: parameter(s) {sparse} received sparse gradients, but only the weights of "
                "nn.Embedding / nn.EmbeddingBag layers built with sparse=True are expected to (torch's rule), "
                "so they were planned into a dense bucket. Use such a layer for them, or compute a dense "
                "gradient (e.g. F.embedding(..., sparse=False))."
            )

    # ------------------------------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        """End of backward: launch what is left, wait for every bucket, write averaged gradients."""
        succeeded = False
        with label("lightning_ddpx::finalize"):
            try:
                ready = self._ready
                missing = [] if ready.find(0) < 0 else [i for i in range(len(ready)) if not ready[i]]
                if self.static is not None:
                    globally_used = self._finalize_static(missing)
                else:
                    if missing and not self.find_unused_parameters:
                        self._wait_launched_quietly()
                        raise RuntimeError(self._unused_message(missing))
                    for index in missing:  # reachable from outputs but not from the loss
                        self._mark_ready(index, used=False)
                    globally_used = self._launch_used_bitmap() if self.find_unused_parameters else None
                if self.overlap is not None:  # each bucket's parameters step as soon as it is written
                    self.last_exposed_comm_s = self.overlap.write_back_and_step(globally_used)
                else:
                    started = time.perf_counter()
                    results = [self._result_of(b) for b in range(len(self.buckets))]
                    used_counts = None
                    if globally_used is not None:
                        with waiting_for(
                            "the used-parameter bitmap (find_unused_parameters)", self.process_group
                        ):
                            used_counts = globally_used.wait()[0].tolist()
                        if self.static is not None:
                            self.static.record(used_counts)
                    elif self.static is not None:
                        used_counts = self.static.globally_used
                    self.last_exposed_comm_s = time.perf_counter() - started
                    with torch.no_grad():
                        for b, result in enumerate(results):
                            self._write_back_bucket(b, result, used_counts)
                if self.collect_stats:
                    self._record_step_stats()
                succeeded = True
            except Exception as error:
                if self.usage_log is not None:
                    self.usage_log.record(error)
                raise
            finally:
                self._end_iteration(succeeded)

    def _finalize_static(self, missing: list[int]) -> torch.futures.Future | None:
        """static_graph: while recording, every gradient is complete now: mark all (used or not) and
        share which are used; afterwards, a parameter short of its recorded count means the graph changed."""
        assert self.static is not None
        if self.static.recording:
            for index in self.static.recording_order():
                self._mark_ready(index, used=self.static.fires[index] > 0)
            return self._launch_used_bitmap()
        if missing:
            self._wait_launched_quietly()
            raise RuntimeError(self.static.missing_message(missing, dist.get_rank(self.process_group)))
        return None

    def _record_step_stats(self) -> None:
        sent = self._sent_log
        stats = StepCommStats(
            iteration=self.iterations_synced + 1,
            buckets=len(self.buckets),
            bytes_to_hook=self._bytes_to_hook,
            bytes_sent=sum(sent) if sent else None,
            hook_s=sum(self._hook_seconds),
            exposed_comm_s=self.last_exposed_comm_s,
        )
        self.last_step_stats = stats
        self.stats_window.add(stats)

    def _launch_used_bitmap(self) -> torch.futures.Future:
        self.progress.record("the used-parameter bitmap in iteration {}", self.iterations_synced + 1)
        bitmap = torch.tensor(
            list(self._locally_used), dtype=torch.int32, device=self.buckets[0].buffer.device
        )
        group = self.process_group
        # CUDA: issued with this (the copying) stream current, also on the communication thread
        issue = on_stream(
            current_stream(bitmap.device),
            lambda: dist.all_reduce(bitmap, group=group, async_op=True).get_future(),
        )
        return self._launcher.submit(issue)

    def _result_of(self, b: int) -> torch.Tensor:
        future = self._futures[b]
        assert future is not None, f"bucket {b} was never launched"
        what = lambda: (  # noqa: E731 - built only if the wait fails
            f"bucket {b} (parameters {self._bucket_names(b)}) of iteration {self.iterations_synced + 1} to be "
            f"reduced by {self._hook_name}"
        )
        try:
            with waiting_for(what, self.process_group):
                value = future.wait()
        except CommunicationError:
            raise
        except Exception as error:
            sparse = (
                " This bucket holds a sparse gradient (an embedding with sparse=True): the hook must reduce "
                "bucket.buffer() as a sparse tensor, or the layer be built with sparse=False."
                if self.buckets[b].spec.sparse
                else ""
            )
            raise RuntimeError(
                f"lightning_ddpx: the communication hook {_hook_name(self.hook)} failed for bucket {b} "
                f"(parameters {self._bucket_names(b)}): {error}{sparse}"
            ) from error
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        buffer = self.buckets[b].buffer
        # CUDA: wait() made the current stream wait for the future's events (torch's CUDA futures: NCCL's, and
        # the communication thread's, engine.launcher); a future without events (a hook's own) did not, so
        # also wait for the stream the hook ran on. No host sync.
        wait_streams(current_stream(buffer.device), [self._launch_streams[b]])
        if self.buckets[b].spec.sparse:
            self._check_sparse_result(b, value)
            return value
        if (
            not isinstance(value, torch.Tensor)
            or value.numel() != buffer.numel()
            or (
                value.dtype != buffer.dtype and not (value.is_floating_point() and buffer.is_floating_point())
            )
        ):
            got = (
                f"{type(value).__name__}"
                if not isinstance(value, torch.Tensor)
                else f"{value.dtype} x {value.numel()}"
            )
            raise RuntimeError(
                f"lightning_ddpx: the communication hook {_hook_name(self.hook)} returned {got} for bucket {b}, "
                f"but the bucket holds {buffer.dtype} x {buffer.numel()} (parameters {self._bucket_names(b)}). "
                "A hook's future must hold the reduced flat buffer: same size as bucket.buffer(), and a floating "
                "dtype (cast back, as torch's reducer does) when the bucket is floating point."
            )
        return value

    def _check_sparse_result(self, b: int, value: Any) -> None:
        param = self.buckets[b].params[0]
        if not (isinstance(value, torch.Tensor) and value.is_sparse and value.shape == param.shape):
            got = (
                type(value).__name__
                if not isinstance(value, torch.Tensor)
                else f"{value.layout} {tuple(value.shape)}"
            )
            raise RuntimeError(
                f"lightning_ddpx: the communication hook {_hook_name(self.hook)} returned {got} for bucket {b}, "
                f"which holds the sparse gradient of parameter {self._bucket_names(b)[0]!r} "
                f"{tuple(param.shape)}. For a sparse bucket a hook's future must hold the reduced sparse tensor, "
                "shaped like the parameter."
            )

    def _write_back_bucket(self, b: int, result: torch.Tensor, used_counts: list[int] | None) -> None:
        """Put bucket ``b``'s reduced gradients into ``param.grad`` (call under ``torch.no_grad()``).

        Parameters unused on every rank (``used_counts``) keep their ``grad``. With bucket views the
        gradients already alias the buffer, so only the buffer is written.
        """
        bucket = self.buckets[b]
        if bucket.spec.sparse:  # the reduced sparse tensor becomes the gradient, unless no rank used it
            index = bucket.spec.param_indices[0]
            if used_counts is None or used_counts[index]:
                bucket.params[0].grad = result
            return
        if result is not bucket.buffer:
            bucket.buffer.copy_(result)
        if self._unused_in_bucket[b] == 0:
            # Every gradient of the bucket arrived on this rank, so each is used and defined, and with bucket
            # views each ``grad`` was made its view at launch: one batched copy, or nothing.
            if not self.gradient_as_bucket_view:
                foreach_copy_([param.grad for param in bucket.params], bucket.views)
            return
        grads, views = [], []
        for index, param, view in zip(bucket.spec.param_indices, bucket.params, bucket.views):
            if used_counts is not None and used_counts[index] == 0:
                continue  # unused on every rank: leave its grad untouched
            if self.gradient_as_bucket_view:
                param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                grads.append(param.grad)
                views.append(view)
        if grads:
            foreach_copy_(grads, views)

    def _end_iteration(self, succeeded: bool) -> None:
        self.phase = Phase.IDLE
        self._reductions += 1
        self._remove_start_hooks()
        self._synced_since_forward = succeeded
        self._locally_used = bytearray(len(self.params))
        if succeeded:
            self.iterations_synced += 1
        if self._ready_order is not None:
            if succeeded and len(self._ready_order) == len(self.params):
                self._observed_order, self._ready_order = self._ready_order, None
                self._rebuild_pending = True
            else:
                self._ready_order = []
        self._reset_iteration()

    def _abandon_iteration(self) -> None:
        self._wait_launched_quietly()
        self._end_iteration(succeeded=False)

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
        observed = self._observed_order
        # a rank that joined before observing an order only receives (same size, values overwritten)
        order = torch.tensor(observed if len(observed) == len(self.params) else range(len(self.params)))
        order = order.to(torch.int64)
        if self.buckets[0].buffer.device.type != "cpu":
            order = order.to(self.buckets[0].buffer.device)
        with waiting_for(f"rank {src}'s gradient ready order to rebuild buckets", self.process_group):
            dist.broadcast(order, group=self.process_group, group_src=src)
        self._install_plan(order.tolist())
        self._rebuild_pending = False

    def close(self) -> None:
        """Remove the gradient hooks and stop the communication thread; the reducer is unusable after."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._launcher.close()
        self.progress.close()

    def adopt_params(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        sparse_gradients: Sequence[bool] | None = None,
    ) -> None:
        """Reduce ``params`` from now on: the module's trainable parameters changed (``requires_grad`` flipped
        after wrapping; :mod:`lightning_ddpx.engine.trainable_set`). Every rank calls this between iterations
        with the same list. As at construction: gradient hooks on the new list, buckets in reverse order,
        re-planned from the next synchronised backward's gradient order, static_graph recording anew; the
        hook, its state and the overlap stay."""
        if self.phase is not Phase.IDLE:
            raise RuntimeError("lightning_ddpx: the reduced parameters can only change between iterations")
        for handle in self._handles:
            handle.remove()
        # "used since the last synchronisation" (no_sync gradients) follows each parameter to its new index
        used_before = {id(p) for p, used in zip(self.params, self._locally_used) if used}
        self.params, self.names = list(params), list(names)
        self.sparse_gradients = list(sparse_gradients or [False] * len(self.params))
        self._locally_used = bytearray(id(p) in used_before for p in self.params)
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._on_cuda = any(p.device.type == "cuda" for p in self.params)
        self._grad_streams = [None] * len(self.params)
        if self.static is not None:
            self.static = StaticGraph(self.names)
        # the slots are sized for whole parameters: keep them if they hold the new set (a subset does), else map
        # new ones (collectives and a new file on two CPU ranks: not on every toggle)
        exchange = self.shared_memory
        if exchange is None or not exchange.holds([p.numel() * p.element_size() for p in self.params]):
            self.shared_memory, self.shared_memory_refusal = self._open_shared_memory()
        self._ready_order, self._rebuild_pending = [], False
        self._install_plan(list(reversed(range(len(self.params)))))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_grad_hook(i)) for i, p in enumerate(self.params)
        ]

    def set_overlap(self, overlap: Any) -> None:
        """Step the optimizer through ``overlap`` at the end of backward (``None``: the plain step). Switching
        between the two re-plans at once along the current buffer order (between iterations only; a rebuild
        may never come again), since with the overlap the last bucket is planned small."""
        replan = (overlap is None) != (self.overlap is None)
        self.overlap = overlap
        if replan:
            self._install_plan([i for bucket in self.buckets for i in bucket.spec.param_indices])

    def order_state(self) -> dict[str, Any]:
        """The bucket layout as plain values: parameter names in buffer order, and whether it was rebuilt."""
        order = [self.names[i] for bucket in self.buckets for i in bucket.spec.param_indices]
        return {"parameter_order": order, "rebuilt": self._ready_order is None and not self._rebuild_pending}

    def load_order_state(self, state: dict[str, Any]) -> None:
        """Adopt a saved layout now (before the first backward), so a resumed run reduces, and its hooks
        see, exactly the buckets the saved run had. Every rank must load the same state."""
        if self.phase is not Phase.IDLE:
            raise RuntimeError("lightning_ddpx: a bucket layout can only be loaded between iterations")
        position = {name: i for i, name in enumerate(self.names)}
        names = list(state["parameter_order"])
        if sorted(names) != sorted(self.names):
            missing = sorted(set(self.names) - set(names))[:5]
            extra = sorted(set(names) - set(self.names))[:5]
            raise ValueError(
                "lightning_ddpx: the saved bucket layout is for other parameters "
                f"(missing here: {extra}, not in the saved layout: {missing}); it cannot be restored."
            )
        self._install_plan([position[name] for name in names])
        if state.get("rebuilt", True):
            self._ready_order, self._rebuild_pending = None, False

    # --------------------------------------------------------------------------------------- errors
    def _bucket_names(self, b: int) -> list[str]:
        names = [self.names[i] for i in self.buckets[b].spec.param_indices]
        return names if len(names) <= 6 else names[:6] + [f"... {len(names) - 6} more"]

    def _unlaunched(self) -> list[int]:
        return [b for b, future in enumerate(self._futures) if future is None]

    def _unused_message(self, missing: list[int]) -> str:
        names = ", ".join(repr(self.names[i]) for i in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        return (
            f"lightning_ddpx: on rank {dist.get_rank(self.process_group)}, parameter(s) {names}{more} received "
            "no gradient in this backward, so their buckets cannot be reduced. Either the forward did not use "
            "them or the loss does not depend on them. Pass find_unused_parameters=True to "
            "DistributedDataParallel (or use strategy 'ddpx_find_unused_parameters_true' in Lightning), "
            "or set requires_grad=False on parameters that are never trained."
        )

    def _backward_after_sync_message(self, index: int) -> str:
        return (
            f"lightning_ddpx (rank {dist.get_rank(self.process_group)}): parameter {self.names[index]!r} received a "
            "gradient in a backward that ran after this iteration's gradients were already synchronised, with no "
            "new forward through DistributedDataParallel (a second backward of the same forward, or a forward "
            "that called .module directly). That gradient would stay on this rank and the ranks would step with "
            "different gradients. Combine the losses into one backward, or run the extra backward inside "
            "no_sync() and synchronise on a later one, and call the wrapper itself for every forward."
        )

    def _ready_twice_message(self, index: int) -> str:
        name = self.names[index]
        if self.find_unused_parameters:
            return (
                f"lightning_ddpx: parameter {name!r} received a gradient after it was marked unused: it is not "
                "reachable from the outputs that forward() returned, yet the loss depends on it. Return every "
                "tensor the loss depends on from forward()."
            )
        return (
            f"lightning_ddpx: parameter {name!r} received a gradient twice in one synchronised iteration "
            "(backward ran more than once after one forward). Run the extra backward passes inside no_sync(), "
            "or combine the losses into one backward."
        )


def _hook_name(hook: Callable) -> str:
    module = getattr(hook, "__module__", None)
    name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)
    return f"{module}.{name}" if module else name
