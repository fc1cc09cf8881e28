"""Stateless hooks: averaging in the gradients' dtype or in fp16/bf16, casting wrappers, and a no-op.

Their state is a process group or ``None`` (the default group), as with torch's hooks. Each issues its
single collective before returning and only casts or copies in callbacks, so each is marked
:func:`~lightning_ddpx.engine.buckets.grad_bucket.collectives_issued_on_call` and runs inline with several buckets in
flight. A wrapper carries the mark of the hook it wraps.

Annotations are real objects here (no ``from __future__ import annotations``) and the bucket is typed
``dist.GradBucket``: torch's ``DistributedDataParallel.register_comm_hook`` compares them with exactly
those, and our :class:`~lightning_ddpx.GradBucket` offers the same methods.
"""

from typing import Any

import torch
import torch.distributed as dist

from lightning_ddpx.engine.buckets.grad_bucket import (
    CommHook,
    GradBucket,
    collectives_issued_on_call,
    issues_collectives_on_call,
    payload_bytes,
    record_bytes_sent,
    sent_log_of,
)
from lightning_ddpx.engine.buckets.sparse import dense_buckets_only
from lightning_ddpx.hooks.layout import TensorSlot, bucket_key, bucket_layout, segment_sizes

__all__ = [
    "allreduce_hook",
    "first_value",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
]


@collectives_issued_on_call
def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket: divide by the world size, then sum-allreduce.

    The same operations in the same order as torch's ``allreduce_hook``, so results match it bit for bit;
    useful as a baseline and as a template.
    """
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(process_group))
    record_bytes_sent(bucket, payload_bytes(buffer))
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(first_value)


def first_value(future: torch.futures.Future) -> torch.Tensor:
    """The tensor of a collective's future, as a Python value (torch's DDP rejects the raw list)."""
    return future.value()[0]


@dense_buckets_only
@collectives_issued_on_call
def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in float16: cast, divide by the world size, allreduce, cast back into the bucket.

    Halves the bytes sent for fp32 gradients. float16 keeps 11 significant bits but overflows above 65504,
    so gradients should be reasonably scaled (they usually are after the division by world size).
    """
    return _cast_allreduce(torch.float16, process_group, bucket)


@dense_buckets_only
@collectives_issued_on_call
def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in bfloat16: cast, divide by the world size, allreduce, cast back into the bucket.

    bfloat16 keeps fp32's range (no overflow) with 8 significant bits. Unlike torch's hook this one is not
    limited to NCCL: gloo on CPU reduces bfloat16 too.
    """
    return _cast_allreduce(torch.bfloat16, process_group, bucket)


def _cast_allreduce(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))
    record_bytes_sent(bucket, payload_bytes(compressed))
    future = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()
    return future.then(lambda done: buffer.copy_(done.value()[0]))


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """Run ``hook`` on a float16 copy of the bucket and cast its result back into the bucket.

    ``fp16_compress_wrapper(allreduce_hook)`` is :func:`fp16_compress_hook`; the use is stacking, e.g.
    ``fp16_compress_wrapper(powersgd_hook)`` sends P and Q in half precision.
    """
    return _cast_wrapper(hook, torch.float16, "fp16")


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """Run ``hook`` on a bfloat16 copy of the bucket and cast its result back into the bucket."""
    return _cast_wrapper(hook, torch.bfloat16, "bf16")


def _cast_wrapper(hook: CommHook, dtype: torch.dtype, label: str) -> CommHook:
    if not callable(hook):
        raise TypeError(f"{label}_compress_wrapper expects a communication hook, got {type(hook).__name__}")

    layouts: dict[int, tuple[tuple, tuple[int, ...], tuple[int, ...], tuple[TensorSlot, ...]]] = {}

    def cast_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        compressed = original.to(dtype)
        inner = bucket if compressed is original else _recast_bucket(bucket, compressed, layouts)
        future = hook(state, inner)

        def cast_back(done: torch.futures.Future) -> torch.Tensor:
            value = done.value()
            return original.copy_(value[0] if isinstance(value, (list, tuple)) else value)

        return future.then(cast_back)

    inner_name = getattr(hook, "__name__", type(hook).__name__)
    # Not torch's "bf16_compress_wrapper_hook": torch's DDP refuses hooks of that name off NCCL.
    cast_hook.__name__ = cast_hook.__qualname__ = f"{label}_cast_{inner_name}"
    cast_hook.__doc__ = f"``{inner_name}`` on a {dtype} copy of the bucket, cast back afterwards."
    if issues_collectives_on_call(hook):
        collectives_issued_on_call(cast_hook)
    return dense_buckets_only(cast_hook)


def _recast_bucket(bucket: Any, buffer: torch.Tensor, layouts: dict) -> GradBucket:
    """A bucket like ``bucket`` whose buffer is ``buffer`` and whose gradients are views into it.

    Built afresh rather than with ``set_buffer``, whose effect on ``gradients()`` differs between our
    bucket (unchanged views) and torch's (views into the new buffer). The layout is read again only when
    the bucket's key changes (e.g. when buckets are rebuilt after the first iteration).
    """
    key = bucket_key(bucket)
    cached = layouts.get(bucket.index())
    if cached is None or cached[0] != key:
        slots = bucket_layout(bucket)
        sizes, where = segment_sizes(buffer.numel(), slots)
        cached = layouts[bucket.index()] = (key, sizes, where, slots)
    _, sizes, where, slots = cached
    segments = buffer.split(sizes)
    views = [segments[w].view(slot.shape) for w, slot in zip(where, slots)]
    names = bucket.parameter_names() if hasattr(bucket, "parameter_names") else None
    return GradBucket(
        bucket.index(),
        buffer,
        views,
        bucket.parameters(),
        bucket.is_last(),
        sent_log=sent_log_of(bucket),
        names=names,
    )


@collectives_issued_on_call
def noop_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return the local gradients unreduced: no communication at all.

    For headroom analysis only (how fast would training be if communication were free?); ranks drift
    apart, so never train a model you keep with it.
    """
    record_bytes_sent(bucket, 0)  # known to send nothing (not "unknown", as for a hook that does not say)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
