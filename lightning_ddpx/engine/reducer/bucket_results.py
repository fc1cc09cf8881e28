"""Waiting for a bucket's reduced result, and checking it is what torch's hook contract promises.

A hook is user code: its future may fail, hold a list, a tensor of another size, or a dense tensor for a
sparse bucket. Each case fails here with the hook, the bucket and its parameters named, instead of a
shape error later in ``param.grad``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import CommunicationError, as_communication_error
from lightning_ddpx.engine.buckets.storage import Bucket

__all__ = ["wait_result"]


def wait_result(
    future: torch.futures.Future,
    b: int,
    bucket: Bucket,
    hook_name: str,
    iteration: int,
    process_group: dist.ProcessGroup,
) -> Any:
    """Bucket ``b``'s reduced value from ``future`` (iteration ``iteration``), checked."""
    try:
        value = future.wait()
    except CommunicationError:
        raise
    except Exception as error:
        what: Callable[[], str] = lambda: (  # noqa: E731 - built only if the wait failed
            f"bucket {b} (parameters {bucket.short_names()}) of iteration {iteration} to be reduced by "
            f"{hook_name}"
        )
        failure = as_communication_error(error, what, process_group)  # a peer failed: say which, and why
        if failure is not None:
            raise failure from error
        sparse = (
            " This bucket holds a sparse gradient (an embedding with sparse=True): the hook must reduce "
            "bucket.buffer() as a sparse tensor, or the layer be built with sparse=False."
            if bucket.spec.sparse
            else ""
        )
        raise RuntimeError(
            f"lightning_ddpx: the communication hook {hook_name} failed for bucket {b} "
            f"(parameters {bucket.short_names()}): {error}{sparse}"
        ) from error
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if value is bucket.buffer:  # reduced in place (the default path, torch's allreduce hook): all checked
        return value
    value = _as_complex_if_viewed_real(value, bucket.buffer)
    if bucket.spec.sparse:
        _check_sparse(value, b, bucket, hook_name)
    else:
        _check_dense(value, b, bucket, hook_name)
    return value


def _as_complex_if_viewed_real(value: Any, buffer: torch.Tensor) -> Any:
    """``dist.all_reduce`` of a complex tensor hands back its ``view_as_real`` (pairs of reals): as torch's
    reducer, read it as the complex bucket it is."""
    if (
        buffer.is_complex()
        and isinstance(value, torch.Tensor)
        and not value.is_complex()
        and value.is_floating_point()
        and value.shape[-1:] == (2,)
        and value.numel() == 2 * buffer.numel()
    ):
        return torch.view_as_complex(value.reshape(-1, 2).contiguous())
    return value


def _check_dense(value: Any, b: int, bucket: Bucket, hook_name: str) -> None:
    buffer = bucket.buffer
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == buffer.numel()
        and (value.dtype == buffer.dtype or (value.is_floating_point() and buffer.is_floating_point()))
    ):
        return
    got = f"{value.dtype} x {value.numel()}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise RuntimeError(
        f"lightning_ddpx: the communication hook {hook_name} returned {got} for bucket {b}, "
        f"but the bucket holds {buffer.dtype} x {buffer.numel()} (parameters {bucket.short_names()}). "
        "A hook's future must hold the reduced flat buffer: same size as bucket.buffer(), and a floating "
        "dtype (cast back, as torch's reducer does) when the bucket is floating point."
    )


def _check_sparse(value: Any, b: int, bucket: Bucket, hook_name: str) -> None:
    param = bucket.params[0]
    if isinstance(value, torch.Tensor) and value.is_sparse and value.shape == param.shape:
        return
    got = f"{value.layout} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise RuntimeError(
        f"lightning_ddpx: the communication hook {hook_name} returned {got} for bucket {b}, "
        f"which holds the sparse gradient of parameter {bucket.names[0]!r} "
        f"{tuple(param.shape)}. For a sparse bucket a hook's future must hold the reduced sparse tensor, "
        "shaped like the parameter."
    )
