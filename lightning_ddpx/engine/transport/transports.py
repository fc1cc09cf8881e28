"""How a bucket crosses the ranks: chosen once, when the reducer is built or a hook is registered.

A transport is the one object that knows the collectives a model's buckets take. Its identity says which
path a model is on (``model.reducer.transport``), and :meth:`Transport.describe` is part of the settings
every rank compares before the first reduction, so ranks on different paths fail with a named
setting instead of a hang.

- :class:`Transport`: a registered communication hook, torch's contract ``hook(state, bucket)``; the
  bucket holds the plain local gradients.
- :class:`MeanAllReduce`: no hook registered. Gradients are scaled by 1/world size while copied into the
  bucket (one pass instead of a copy and a multiply), then summed by one all-reduce per bucket. The path of
  NCCL, of more than two ranks and of ranks on different machines.
- :class:`SharedMemorySum`: no hook, two CPU ranks on one machine. Each rank copies its gradients straight
  into its slot of a shared file, one tiny gloo all-reduce says both slots are written, and each rank adds
  the two slots (:mod:`lightning_ddpx.engine.transport.shared_memory`; bit-identical to gloo's two-rank sum;
  0.77-0.98x torch's step, docs/benchmarks.md).

Benchmarks compare paths by handing a reducer another transport (:meth:`Reducer.use_transport
<lightning_ddpx.engine.reducer.reducer.Reducer.use_transport>`), never by switches on these classes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.buckets.grad_bucket import (
    CommHook,
    GradBucket,
    collectives_issued_on_call,
    issues_collectives_on_call,
    payload_bytes,
    record_bytes_sent,
)
from lightning_ddpx.engine.buckets.storage import Bucket, param_views
from lightning_ddpx.engine.transport.cuda_streams import GradientStreams, wait_streams
from lightning_ddpx.engine.transport.launcher import InlineLauncher, SequencedLauncher
from lightning_ddpx.engine.transport.shared_memory import (
    SharedMemoryExchange,
    gather_obstacles,
    local_obstacles,
    obstacles_refusal,
    open_exchange,
)

__all__ = [
    "LocalGradients",
    "MeanAllReduce",
    "SharedMemorySum",
    "Transport",
    "UndecidedDefault",
    "choose_default",
    "hook_name",
]


def hook_name(hook: Callable) -> str:
    """``module.qualname`` of a hook, for progress records, errors and the settings every rank compares:
    the same on every rank for the same hook (no address), so a ``functools.partial`` is named by the
    function it wraps and a callable object by its class."""
    if isinstance(hook, functools.partial):
        return f"functools.partial({hook_name(hook.func)})"
    named = hook if getattr(hook, "__qualname__", None) else type(hook)
    module = getattr(named, "__module__", None)
    return f"{module}.{named.__qualname__}" if module else named.__qualname__


def _sum_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    options.asyncOp = True  # as dist.all_reduce(..., async_op=True) sets it (on NCCL: its own stream)
    return options


_SUM = _sum_options()  # read only by the process groups, so one serves every call


@collectives_issued_on_call
def _sum_allreduce_hook(process_group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
    """The default path's hook: gradients were already scaled by 1/world_size while copied into the bucket.

    It calls the process group's ``allreduce`` itself: ``dist.all_reduce`` adds, per call, checks that
    cannot fail here (a plain tensor, this rank in the group, no coalescing block) and a logging wrapper
    that re-raises the same error; what remains of it is done here (a complex bucket is reduced as its
    real view, which :mod:`~lightning_ddpx.engine.reducer.bucket_results` reads back as complex)."""
    buffer = bucket.buffer()
    record_bytes_sent(bucket, payload_bytes(buffer))
    if buffer.is_complex():
        buffer = torch.view_as_real(buffer)
    return process_group.allreduce([buffer], _SUM).get_future()


class LocalGradients(NamedTuple):
    """This rank's gradients of one full bucket, as the reducer knows them when it launches the bucket (a
    tuple: made per bucket, so as cheap to make as Python allows)."""

    used: bytearray  # per parameter of the reducer: 1 if it produced a gradient on this rank
    all_used: bool  # every parameter of the bucket produced a gradient in this backward
    as_view: bool  # gradient_as_bucket_view: the gradients already live in the bucket's buffer
    streams: GradientStreams | None  # CUDA: each gradient's producing stream (None off CUDA)
    stream: Any  # CUDA: the stream the bucket is launched from (None off CUDA)


class Transport:
    """A transport, as a registered hook (the default paths below derive from it): called with its state
    on each bucket, inline when it issues its collectives
    before returning (:func:`~lightning_ddpx.engine.buckets.grad_bucket.collectives_issued_on_call`), else on one
    communication thread, so every rank issues them in bucket order."""

    scale: float | None = None  # a registered hook sees the plain local gradients ...
    divisor: int | None = None  # ... and divides them itself

    def __init__(self, hook: CommHook, state: Any, device: torch.device | None) -> None:
        self.hook, self.state = hook, state
        self.name = hook_name(hook)
        # CUDA: the communication thread's futures carry events on the buckets' device (engine.launcher)
        self.launcher: InlineLauncher | SequencedLauncher = (
            InlineLauncher() if issues_collectives_on_call(hook) else SequencedLauncher(device=device)
        )

    def describe(self) -> str:
        return f"the communication hook {self.name}"

    def serves(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Whether this transport goes on serving a new parameter set (the trainable set changed): a
        registered hook does."""
        return True

    def set_divisor(self, count: int) -> None:
        """A registered hook divides by what it likes: nothing to change."""

    def begin_reduction(self) -> None:
        """A synchronised backward (or a joined rank's shadow of one) starts: its hook calls form one
        sequence (a failed one stops the rest: :mod:`lightning_ddpx.engine.transport.launcher`)."""
        self.launcher.begin_sequence()

    def set_layout(self, buckets: Sequence[Bucket]) -> None:
        """A new bucket plan was installed (every rank the same one, between iterations)."""

    def fill_target(self, b: int, bucket: Bucket) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Where to copy bucket ``b``'s gradients, if not into its own buffer."""
        return None

    def fill(
        self, b: int, bucket: Bucket, local: LocalGradients
    ) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
        """Put this rank's contribution to bucket ``b`` (its gradients, as ``local`` describes them) where
        this transport takes it, scaled as it asks; returns (buffer, views, whether it went to
        :meth:`fill_target`)."""
        scale, indices = bucket.scale_to_apply(self.scale), bucket.spec.param_indices
        streams, stream = local.streams, local.stream
        others = streams.others(indices, stream) if streams is not None else []
        if bucket.spec.sparse:
            wait_streams(stream, others)
            return bucket.sparse_contribution(local.used[indices[0]], self.divisor), [], False
        if local.as_view:
            wait_streams(stream, others)  # CUDA: the views were written in each gradient's own hook
            bucket.adopt_grads_as_views(None if local.all_used else local.used)
            if scale is not None:
                bucket.buffer.mul_(scale)
        elif others:
            assert streams is not None
            streams.copy_on_producers(indices, bucket.params, bucket.views, scale, stream)
        else:
            target = self.fill_target(b, bucket)
            bucket.fill(scale, local.all_used, target)
            return bucket.buffer, bucket.views, target is not None
        return bucket.buffer, bucket.views, False

    def reduce(self, grad_bucket: GradBucket, prefilled: bool) -> torch.futures.Future:
        """Issue bucket's reduction; ``prefilled``: the gradients went to :meth:`fill_target`."""
        return self.hook(self.state, grad_bucket)

    def shadow(self, grad_bucket: GradBucket) -> torch.futures.Future:
        """The collectives of :meth:`reduce`, for a joined rank's bucket of zeros."""
        return self.reduce(grad_bucket, prefilled=False)

    def close(self) -> None:
        self.launcher.close()


class MeanAllReduce(Transport):
    """No hook registered: scaled while copied, then one sum all-reduce per bucket (a sparse bucket's
    gradient is divided into a new tensor, as torch's reducer does, and summed by a sparse all-reduce)."""

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        super().__init__(_sum_allreduce_hook, process_group, device=None)
        self.set_divisor(dist.get_world_size(process_group))

    def describe(self) -> str:
        return "the mean all-reduce (no hook)"

    def serves(self, params: Sequence[torch.nn.Parameter]) -> bool:
        return False  # the default path is chosen anew for new parameters (choose_default)

    def set_divisor(self, count: int) -> None:
        """Average over ``count`` ranks from now on (``join(divide_by_initial_world_size=False)`` sets the
        number of ranks still training, as torch does)."""
        self.scale = 1.0 / count
        self.divisor = count


class SharedMemorySum(MeanAllReduce):
    """No hook, two CPU ranks on one machine: summed through both ranks' slots of a shared file."""

    def __init__(self, process_group: dist.ProcessGroup, exchange: SharedMemoryExchange) -> None:
        super().__init__(process_group)
        self.exchange = exchange
        # per bucket, per generation: this rank's slot and views into it (a view costs about as much as
        # copying 4 KB, so they are made once per plan)
        self._slot_views: list[dict[int, tuple[torch.Tensor, list[torch.Tensor]]]] = []

    def describe(self) -> str:
        return "the shared-memory sum of two CPU ranks (no hook)"

    def serves(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """The slots are sized for whole parameters: they hold a new set that fits (a subset does), else
        they are mapped anew (collectives and a new file: not on every toggle)."""
        return self.exchange.holds([p.numel() * p.element_size() for p in params])

    def begin_reduction(self) -> None:
        super().begin_reduction()
        self.exchange.next_generation()  # every reduction, so that it stays in step with the other rank

    def set_layout(self, buckets: Sequence[Bucket]) -> None:
        self.exchange.set_layout([bucket.nbytes for bucket in buckets])
        self._slot_views = [{} for _ in buckets]

    def fill_target(self, b: int, bucket: Bucket) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        if bucket.spec.sparse:
            return None
        cached = self._slot_views[b]
        generation = self.exchange.generation
        if generation not in cached:
            slot = self.exchange.own_slot(b, bucket.buffer)
            cached[generation] = (slot, param_views(slot, bucket.spec, bucket.params))
        return cached[generation]

    def reduce(self, grad_bucket: GradBucket, prefilled: bool) -> torch.futures.Future:
        if grad_bucket.buffer().is_sparse:
            return super().reduce(grad_bucket, prefilled)
        if prefilled:
            return self.exchange.sum_filled_hook(self.state, grad_bucket)
        return self.exchange.sum_hook(self.state, grad_bucket)  # copies the buffer into the slot first


class UndecidedDefault(MeanAllReduce):
    """No hook, two gloo ranks, and no collective has yet said whether both can use shared memory: the
    reducer was built without the model check that carries it (``init_sync=False``, unpickled, or a new
    group from ``use_process_group``). Such a construction issues no collective, and the choice is made
    later, at a point every rank reaches in step: the settings check before the first reduction or buffer
    broadcast, whose all-gather carries each rank's obstacles (:meth:`Reducer.settle_default
    <lightning_ddpx.engine.reducer.reducer.Reducer.settle_default>`).

    Why not at construction: a rank's construction is not always in step with the other rank's collectives.
    A fault-tolerant survivor moves its module onto the new group and then sends the newcomer its state,
    while the newcomer receives that state before its module exists; an all-gather at either construction met
    the other side's state transfer, and the pair waited out the collective timeout at every generation."""

    def describe(self) -> str:
        return "the default path, not chosen yet (chosen with the settings check, the same on every rank)"


def choose_default(
    process_group: dist.ProcessGroup,
    params: Sequence[torch.nn.Parameter],
    sparse_gradients: Sequence[bool],
    obstacles: list[int] | None,
    *,
    defer: bool = True,
) -> tuple[MeanAllReduce, str | None, list[int] | None]:
    """The default path for these parameters: shared memory when both of two gloo ranks can map it, else
    the mean all-reduce. Returns it, why not shared memory (``None`` when it is), and every rank's shared-
    memory obstacles.

    No collective when every rank knows alike that shared memory is out (world size, backend) or when the
    obstacles rule it out (``DDPX_SHARED_MEMORY=0`` on any rank...). Without ``obstacles`` (no collective
    carried them yet): :class:`UndecidedDefault`, no collective, when ``defer``; else one all-gather asks.
    Otherwise collective (:mod:`lightning_ddpx.engine.transport.shared_memory`, "Set-up")."""
    world_size = dist.get_world_size(process_group)
    backend = dist.get_backend(process_group)
    if world_size != 2:
        why = f"{world_size} ranks: shared memory serves two (more would not sum like gloo's ring)"
        return MeanAllReduce(process_group), why, obstacles
    if backend != "gloo":
        return MeanAllReduce(process_group), f"backend {backend!r} rather than gloo", obstacles
    if obstacles is None and defer:
        why = "not chosen yet: the settings check before the first reduction asks every rank"
        return UndecidedDefault(process_group), why, None
    if obstacles is None:  # a reducer reducing without its module's settings check (tests, benchmarks)
        on_cpu = all(p.device.type == "cpu" for p in params)
        with waiting_for("the other rank to say whether it can use shared memory", process_group):
            obstacles = gather_obstacles(process_group, local_obstacles(on_cpu))
    refusal = obstacles_refusal(obstacles, dist.get_rank(process_group))
    if refusal is not None:
        return MeanAllReduce(process_group), refusal, obstacles
    sizes = [0 if sparse else p.numel() * p.element_size() for p, sparse in zip(params, sparse_gradients)]
    with waiting_for("the other rank to map the shared-memory slots", process_group):
        exchange, refusal = open_exchange(process_group, sizes)
    if exchange is None:
        return MeanAllReduce(process_group), refusal, obstacles
    return SharedMemorySum(process_group, exchange), None, obstacles
