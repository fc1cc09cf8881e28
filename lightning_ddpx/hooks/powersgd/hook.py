"""PowerSGD hooks (Vogels et al., NeurIPS 2019): per-tensor and whole-bucket low-rank compression.

Both hooks run plain averaging for the first ``start_powerSGD_iter`` steps, then compress. They block:
each issues its collectives and waits for them inside the hook, and returns a completed future. The
reducer runs unmarked hooks on its communication thread, so backward still overlaps, and blocking gives
one global order of collectives on every rank however many buckets there are (torch's hook chains its
collectives from gloo's callback threads and aborts with a collective mismatch on several CPU buckets).

Per compressed step and bucket, :func:`powersgd_hook` does, with torch's order of operations:

1. X = gradient + error (error feedback), for every compressed matrix, packed by shape;
2. Q: a seeded random draw (first step, or every step without warm start) or last step's Q;
   orthogonalise Q (batched per shape group); P = X Q;
3. one allreduce carrying every P and the uncompressed gradients (torch sends these two separately;
   the sums are the same elementwise, one round trip fewer);
4. uncompressed gradients = sum / world size; orthogonalise P; Q = X^T P; allreduce Q; Q /= world size;
5. gradient = P Q^T; error = X - P Q^T.

Work buffers are allocated once per bucket and reused; copies between the bucket and the packed buffers
are single ``_foreach`` calls and orthogonalisation is batched per shape group. Matrix products are one
``mm`` per matrix, which on CPU beats batched ``bmm`` by ~10x (see ``_TensorwiseRuntime``).
"""

import warnings
from typing import Any

import torch
import torch.distributed as dist

from lightning_ddpx._compat.torch import foreach_add_, foreach_copy_, foreach_sub_
from lightning_ddpx.engine.buckets.grad_bucket import payload_bytes, record_bytes_sent
from lightning_ddpx.engine.buckets.sparse import dense_buckets_only
from lightning_ddpx.engine.profiling import label
from lightning_ddpx.hooks.default import first_value
from lightning_ddpx.hooks.layout import bucket_key, bucket_layout, layout_signature, segment_sizes
from lightning_ddpx.hooks.powersgd import remap as powersgd_remap
from lightning_ddpx.hooks.powersgd.lowrank import (
    left_project_,
    orthogonalize_,
    reconstruct_,
    right_project_,
    square_side,
)
from lightning_ddpx.hooks.powersgd.plan import PowerSGDPlan, plan_powersgd
from lightning_ddpx.hooks.powersgd.state import PowerSGDState

__all__ = ["batched_powersgd_hook", "powersgd_hook"]


@dense_buckets_only
def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD on each gradient matrix of the bucket (torch's ``powerSGD_hook``, blocking and batched).

    Gradients are compressed as ``(shape[0], rest)`` matrices when that saves ``min_compression_rate`` x
    (see :func:`~lightning_ddpx.hooks.powersgd.lowrank.should_compress`); the rest (biases, small layers) are
    averaged exactly. With the same options, results match torch's hook within 1e-5 (tested over 10
    compressed steps; the remaining differences are float rounding of differently blocked products).

    Example::

        >>> from lightning_ddpx.hooks import PowerSGDState, powersgd_hook
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> model.register_comm_hook(state, powersgd_hook)  # doctest: +SKIP
        >>> # the first 10 synchronised steps average exactly, later ones are compressed
        >>> loss_fn(model(x), y).backward()  # doctest: +SKIP
    """
    return _reduce(state, bucket, _TensorwiseRuntime, "lightning_ddpx::powersgd")


@dense_buckets_only
def batched_powersgd_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD on the whole bucket viewed as one square matrix, zero padded (torch's batched variant).

    Cheaper than :func:`powersgd_hook` (one matrix per bucket, no per-shape work) but the square view
    mixes unrelated rows and columns, so it approximates worse; prefer rank 1 and check accuracy.
    Unlike torch 2.13's ``batched_powerSGD_hook``, which fails in its first compressed step, this runs.
    """
    return _reduce(state, bucket, _SquareRuntime, "lightning_ddpx::batched_powersgd")


# ------------------------------------------------------------------------------------------ helpers
def _reduce(
    state: PowerSGDState, bucket: Any, runtime_class: type, profile_label: str
) -> torch.futures.Future[torch.Tensor]:
    """What both hooks do per bucket: plain averaging until compression starts, then one compressed step
    with the bucket's runtime (built anew when the bucket changed), counted in the statistics."""
    if not state.compressing():
        state.end_bucket(bucket, None)
        return _average(state.process_group, bucket)
    with torch.no_grad(), label(profile_label):
        runtime = state.runtime.get(bucket.index())
        if not isinstance(runtime, runtime_class) or not runtime.fits(bucket):
            runtime = state.runtime[bucket.index()] = runtime_class(state, bucket)
        runtime.step(state, bucket.buffer())
        state.end_bucket(bucket, runtime.counts)
    record_bytes_sent(bucket, runtime.bytes_sent)
    return _completed(bucket.buffer())


def _average(group: dist.ProcessGroup | None, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Plain averaging before compression starts (divide, then sum: torch's allreduce hook)."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    record_bytes_sent(bucket, payload_bytes(buffer))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(first_value)


def _completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    devices = [value.device] if value.device.type != "cpu" else None
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    future.set_result(value)
    return future


def _draw_q(state: PowerSGDState, q: torch.Tensor, draw_sizes: tuple[int, ...]) -> None:
    """Fill ``q`` with standard normal draws exactly as torch's hook does, without touching global RNG.

    One seed per bucket from the shared numpy generator; a CPU generator seeded with it fills consecutive
    slices of ``draw_sizes`` elements (torch draws one tensor per slice, and the values depend on the
    slicing). Every rank draws the same numbers.
    """
    generator = torch.Generator().manual_seed(int(state.shared.rng.randint(1_000_000_000)))
    flat = q.view(-1)  # slices of draw_sizes elements, whatever q's shape (the square runtime's is 2-D)
    target = flat if q.device.type == "cpu" else torch.empty(q.numel(), dtype=q.dtype)
    offset = 0
    for size in draw_sizes:
        target[offset : offset + size].normal_(generator=generator)
        offset += size
    if target is not flat:
        flat.copy_(target)  # drawn on the CPU generator, as torch does, then moved to q's device


def _claim_memory(
    state: PowerSGDState, index: int, signature: tuple[int, ...], names: tuple[str, ...] | None = None
) -> None:
    """Tie bucket ``index``'s memory to the layout ``signature`` of the parameters ``names``.

    Memory of the same layout (e.g. just loaded from a checkpoint) is kept. When the layout changed
    (buckets rebuilt, a fresh module, another bucket cap) and the parameters are known by name, the memory
    of every old bucket holding one of this bucket's parameters moves to the per-parameter pools, from
    which the new buckets take it (:func:`_take_pooled`). Without names (torch's ``GradBucket``, the
    batched hook's square) it is dropped with a warning: applying it by position would add one tensor's
    error to another.
    """
    shared = state.shared
    if shared.layout.get(index) == signature and shared.names.get(index) in (names, None):
        if names is not None:
            shared.names[index] = names  # memory saved before names were recorded: same layout, kept
        return
    if names is not None:
        _pool_memory_of(state, index, set(names))
        shared.layout[index], shared.names[index] = signature, names
        return
    shared.names.pop(index, None)
    if index in shared.q or index in state.per_rank.error:
        warnings.warn(
            f"PowerSGD memory for bucket {index} was built for another bucket layout (the buckets changed "
            "since it was saved or created); its error feedback and warm-start Q are reset.",
            stacklevel=4,
        )
    shared.q.pop(index, None)
    state.per_rank.error.pop(index, None)
    shared.layout[index] = signature


def _pool_memory_of(state: PowerSGDState, index: int, names: set[str]) -> None:
    """Cut the memory of bucket ``index`` and of every saved bucket sharing a parameter with ``names`` into
    per-parameter pieces (such buckets changed too, so their runtimes are rebuilt and take pieces back)."""
    shared, options = state.shared, state.options
    for i in list(shared.layout):
        old_names = shared.names.get(i)
        if i != index and (old_names is None or names.isdisjoint(old_names)):
            continue
        q, error = shared.q.pop(i, None), state.per_rank.error.pop(i, None)
        signature = shared.layout.pop(i)
        shared.names.pop(i, None)
        if old_names is None or signature[:1] == (-1,):
            if q is not None or error is not None:
                warnings.warn(
                    f"PowerSGD memory for bucket {i} was built for another bucket layout and does not name its "
                    "parameters; its error feedback and warm-start Q are reset.",
                    stacklevel=5,
                )
            continue
        slots = powersgd_remap.slots_of(signature)
        end = max((slot.offset + slot.numel for slot in slots), default=0)
        plan = plan_powersgd(
            end,
            slots,
            options.matrix_approximation_rank,
            options.min_compression_rate,
            options.batch_tensors_with_same_shape,
        )
        q_pieces, error_pieces = powersgd_remap.explode(plan, old_names, q, error)
        shared.q_pool.update(q_pieces)
        state.per_rank.error_pool.update(error_pieces)


def _take_pooled(
    pool: dict[str, torch.Tensor],
    plan: PowerSGDPlan,
    names: tuple[str, ...] | None,
    out: torch.Tensor,
    kind: str,
) -> bool:
    """Fill ``out`` with this bucket's pooled pieces; whether every compressed matrix had one."""
    if names is None or not pool:
        return False
    return powersgd_remap.assemble(plan, names, pool, out, kind)


def _memory(
    store: dict[int, torch.Tensor], index: int, numel: int, like: torch.Tensor
) -> torch.Tensor | None:
    """This bucket's saved tensor moved to the bucket's device and dtype, or None if there is none."""
    saved = store.get(index)
    if saved is None:
        return None
    if saved.numel() != numel:
        raise RuntimeError(
            f"PowerSGD memory for bucket {index} has {saved.numel()} elements where its layout needs {numel}; "
            "the state_dict was edited or comes from another version. Start from a fresh PowerSGDState."
        )
    store[index] = adopted = saved.to(device=like.device, dtype=like.dtype).reshape(numel)
    return adopted


class _TensorwiseRuntime:
    """Plan and work buffers of one bucket for :func:`powersgd_hook`."""

    def __init__(self, state: PowerSGDState, bucket: Any) -> None:
        buffer = bucket.buffer()
        options = state.options
        self.key = bucket_key(bucket)
        self.index = bucket.index()
        self.plan: PowerSGDPlan = plan_powersgd(
            buffer.numel(),
            bucket_layout(bucket),
            options.matrix_approximation_rank,
            options.min_compression_rate,
            options.batch_tensors_with_same_shape,
        )
        plan = self.plan
        self.counts = (plan.numel_before, plan.numel_after)
        self.segment_sizes, self.segment_of = segment_sizes(plan.numel, plan.slots)
        self.world_size = dist.get_world_size(state.process_group)
        new = dict(dtype=buffer.dtype, device=buffer.device)

        # Round one sends [P | uncompressed]; Q lives in the shared memory (warm start).
        self.round_one = torch.empty(plan.p_numel + plan.uncompressed_numel, **new)
        self.p = self.round_one[: plan.p_numel]
        self.uncompressed_packed = self.round_one[plan.p_numel :]
        names = bucket.parameter_names() if hasattr(bucket, "parameter_names") else None
        _claim_memory(state, self.index, layout_signature(plan.slots), names)
        q = _memory(state.shared.q, self.index, plan.q_numel, buffer)
        self.q = q if q is not None else torch.empty(plan.q_numel, **new)
        self.q_ready = q is not None  # False until the first random draw has filled it
        if q is None and _take_pooled(state.shared.q_pool, plan, names, self.q, "q"):
            self.q_ready = True  # every matrix's warm-start Q came from the bucket layout before
            if options.warm_start:
                state.shared.q[self.index] = self.q
        # X, the matrices to compress: the error buffer itself with error feedback, else a work buffer.
        error = None
        if options.use_error_feedback:
            error = _memory(state.per_rank.error, self.index, plan.packed_numel, buffer)
            if error is None:
                error = torch.zeros(plan.packed_numel, **new)
                _take_pooled(state.per_rank.error_pool, plan, names, error, "error")
            state.per_rank.error[self.index] = error
        self.error = error
        self.x = error if error is not None else torch.empty(plan.packed_numel, **new)

        # Per shape group: (batch, rows, cols|rank) views for orthogonalisation, which is batched. Per
        # matrix: 2-D views for the products. Matrix products are one mm per matrix, not one bmm per
        # group: on CPU, batched bmm is ~10x slower than a loop of single products (torch 2.13).
        self.p_groups, self.q_groups, self.matrices = [], [], []
        for g in plan.groups:
            n, m, r, b = g.rows, g.cols, g.rank, g.batch
            x = self.x[g.packed_offset : g.packed_offset + b * n * m].view(b, n, m)
            p = self.p[g.p_offset : g.p_offset + b * n * r].view(b, n, r)
            q = self.q[g.q_offset : g.q_offset + b * m * r].view(b, m, r)
            self.p_groups.append(p)
            self.q_groups.append(q)
            self.matrices.extend(zip(x.unbind(0), p.unbind(0), q.unbind(0)))
        self.x_members = [x.view(-1) for x, _, _ in self.matrices]
        unc_sizes = [plan.slots[i].numel for i in plan.uncompressed]
        self.uncompressed_members = list(self.uncompressed_packed.split(unc_sizes))
        self._views_for: int | None = None
        # Payload of one step: [P | uncompressed] and Q; the whole bucket when nothing is worth compressing.
        self.bytes_sent = payload_bytes(self.round_one, self.q) if plan.groups else payload_bytes(buffer)

    def fits(self, bucket: Any) -> bool:
        return self.key == bucket_key(bucket)

    def _bind(self, buffer: torch.Tensor) -> None:
        """Views into the bucket buffer; rebuilt only when the engine hands over a different buffer."""
        if self._views_for == buffer.data_ptr():
            return
        plan = self.plan
        segments = buffer.split(self.segment_sizes)
        flat = [segments[w] for w in self.segment_of]
        self.bucket_compressed = [flat[i] for i in plan.compressed]
        self.bucket_uncompressed = [flat[i] for i in plan.uncompressed]
        self.targets = [view.view(x.shape) for view, (x, _, _) in zip(self.bucket_compressed, self.matrices)]
        self._buffer = buffer  # keeps the storage the views point into alive
        self._views_for = buffer.data_ptr()

    def step(self, state: PowerSGDState, buffer: torch.Tensor) -> None:
        plan, options, group = self.plan, state.options, state.process_group
        if not plan.groups:  # nothing worth compressing here: plain average, sum first as torch does
            dist.all_reduce(buffer, group=group)
            buffer.div_(self.world_size)
            return
        self._bind(buffer)
        epsilon = options.orthogonalization_epsilon
        if self.error is not None:
            foreach_add_(self.x_members, self.bucket_compressed)
        else:
            foreach_copy_(self.x_members, self.bucket_compressed)
        if self.bucket_uncompressed:
            foreach_copy_(self.uncompressed_members, self.bucket_uncompressed)

        if not (options.warm_start and self.q_ready):
            _draw_q(state, self.q, plan.q_draw_sizes)
            self.q_ready = True
            if options.warm_start:
                state.shared.q[self.index] = self.q
        for q in self.q_groups:
            orthogonalize_(q, epsilon)
        for x, p, q in self.matrices:
            right_project_(p, x, q)

        dist.all_reduce(self.round_one, group=group)
        if self.bucket_uncompressed:
            self.uncompressed_packed.div_(self.world_size)
            foreach_copy_(self.bucket_uncompressed, self.uncompressed_members)
        for p in self.p_groups:
            orthogonalize_(p, epsilon)
        for x, p, q in self.matrices:
            left_project_(q, x, p)
        dist.all_reduce(self.q, group=group)
        self.q.div_(self.world_size)

        for (_, p, q), target in zip(self.matrices, self.targets):
            reconstruct_(target, p, q)
        if self.error is not None:
            foreach_sub_(self.x_members, self.bucket_compressed)


class _SquareRuntime:
    """Work buffers of one bucket for :func:`batched_powersgd_hook`: the bucket as a padded square."""

    def __init__(self, state: PowerSGDState, bucket: Any) -> None:
        buffer = bucket.buffer()
        options = state.options
        self.key = bucket_key(bucket)
        self.index = bucket.index()
        self.numel = numel = buffer.numel()
        self.side = side = square_side(numel)
        self.rank = rank = min(side, options.matrix_approximation_rank)
        self.counts = (numel, 2 * side * rank)
        self.world_size = dist.get_world_size(state.process_group)
        new = dict(dtype=buffer.dtype, device=buffer.device)
        self.full_rows = numel // side  # rows of the square lying wholly inside the bucket
        _claim_memory(state, self.index, (-1, numel))  # -1: a square layout, never a tensorwise one
        q = _memory(state.shared.q, self.index, side * rank, buffer)
        self.q_ready = q is not None
        self.q = (q if q is not None else torch.empty(side * rank, **new)).view(1, side, rank)
        self.p = torch.empty(side * rank, **new).view(1, side, rank)
        error = None
        if options.use_error_feedback:
            error = _memory(state.per_rank.error, self.index, side * side, buffer)
            if error is None:
                error = torch.zeros(side * side, **new)
            state.per_rank.error[self.index] = error
        self.error = error
        self.x = error if error is not None else torch.zeros(side * side, **new)
        self.x_square = self.x.view(1, side, side)
        self.tail = torch.empty((side - self.full_rows) * side, **new)  # P Q^T rows past the bucket's end
        self.bytes_sent = payload_bytes(self.p, self.q)  # payload of one step

    def fits(self, bucket: Any) -> bool:
        return self.key == bucket_key(bucket)

    def step(self, state: PowerSGDState, buffer: torch.Tensor) -> None:
        options, group, numel, side = state.options, state.process_group, self.numel, self.side
        epsilon = options.orthogonalization_epsilon
        if self.error is not None:
            self.x[:numel].add_(buffer)  # the padding keeps its own error, as in torch's hook
        else:
            self.x[:numel].copy_(buffer)  # the padding stays zero: nothing else writes X
        if not (options.warm_start and self.q_ready):
            _draw_q(state, self.q, (self.q.numel(),))
            self.q_ready = True
            if options.warm_start:
                state.shared.q[self.index] = self.q.view(-1)
        x, p, q = self.x_square[0], self.p[0], self.q[0]
        orthogonalize_(self.q, epsilon)
        right_project_(p, x, q)
        dist.all_reduce(self.p, group=group)
        orthogonalize_(self.p, epsilon)
        left_project_(q, x, p)
        dist.all_reduce(self.q, group=group)
        self.q.div_(self.world_size)

        # P Q^T: full rows straight into the bucket, the last partial row(s) through a small buffer.
        k = self.full_rows
        if k:
            torch.mm(p[:k], q.t(), out=buffer[: k * side].view(k, side))
        if k < side:
            torch.mm(p[k:], q.t(), out=self.tail.view(side - k, side))
            buffer[k * side :].copy_(self.tail[: numel - k * side])
        if self.error is not None:
            self.x[:numel].sub_(buffer)
            if k < side:
                self.x[numel:].sub_(self.tail[numel - k * side :])
