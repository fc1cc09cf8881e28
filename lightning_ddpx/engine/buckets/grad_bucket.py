"""The object a communication hook receives, and the contract on how hooks are launched.

A hook has torch's signature ``hook(state, bucket) -> torch.futures.Future[Tensor]`` and the bucket
offers torch's ``GradBucket`` methods, so the hooks in ``torch.distributed.algorithms.ddp_comm_hooks``
run unchanged on our reducer.

Launch contract (why hooks may block): every rank must issue collectives in one global order, or gloo
aborts with a collective mismatch or the job hangs. A hook that chains collectives from future
callbacks (torch's PowerSGD does) issues them on gloo's threads, racing the next bucket's collective.
The reducer therefore runs hooks on one communication thread per module, strictly in bucket order,
and waits for a hook's future before calling the next hook. Such a hook may also simply block (run its
collectives synchronously) and return a completed future: it still overlaps the rest of backward.
A hook that issues *every* collective before it returns can say so with
:func:`collectives_issued_on_call`; the reducer then calls it inline on the autograd thread and does
not wait between buckets, exactly like torch's C++ reducer. torch's own allreduce, fp16/bf16 compress and
noop hooks are known to qualify and get the same treatment.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, TypeVar

import torch

from lightning_ddpx._compat.torch import sparse_nnz_bytes

__all__ = [
    "CommHook",
    "GradBucket",
    "collectives_issued_on_call",
    "issues_collectives_on_call",
    "payload_bytes",
    "record_bytes_sent",
    "sent_log_of",
]

_ON_CALL_ATTRIBUTE = "_lightning_ddpx_collectives_issued_on_call"

HookT = TypeVar("HookT", bound=Callable)


def collectives_issued_on_call(hook: HookT) -> HookT:
    """Mark ``hook`` as issuing all of its collectives before it returns (none from callbacks).

    Marked hooks are called inline on the autograd thread and several buckets may be in flight at
    once. Only mark a hook that never starts a collective from a ``Future.then`` callback.

    Example::

        >>> import torch.distributed as dist
        >>> from lightning_ddpx import collectives_issued_on_call
        >>> @collectives_issued_on_call
        ... def mean_hook(state, bucket):
        ...     tensor = bucket.buffer().div_(dist.get_world_size())
        ...     return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])
        >>> model.register_comm_hook(None, mean_hook)  # doctest: +SKIP
    """
    setattr(hook, _ON_CALL_ATTRIBUTE, True)
    return hook


def issues_collectives_on_call(hook: Callable) -> bool:
    """Whether ``hook`` was marked with :func:`collectives_issued_on_call`, or is one of torch's own hooks
    that issue every collective before returning (:func:`_torch_hooks_issuing_on_call`)."""
    return bool(getattr(hook, _ON_CALL_ATTRIBUTE, False)) or hook in _torch_hooks_issuing_on_call()


@functools.lru_cache(maxsize=1)
def _torch_hooks_issuing_on_call() -> tuple[Callable, ...]:
    """torch's hooks that are safe to call inline, as read in their source (torch 2.6-2.13): ``allreduce_hook``
    and the fp16/bf16 compress hooks start their one allreduce before returning and chain only a division or
    a cast back; ``noop_hook`` communicates nothing. A drop-in user registering them then gets the inline
    launch our own twins get (several buckets in flight, no thread hand-off). Their wrappers are closures
    around any hook, and PowerSGD chains collectives from callbacks: neither is listed."""
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks

    return (
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
        debugging_hooks.noop_hook,
    )


class GradBucket:
    """One bucket of flattened gradients, as handed to a communication hook.

    ``buffer()`` is the flat 1-D tensor holding every gradient of the bucket; ``gradients()`` are views
    into it shaped like the parameters, so a hook that writes into them writes into the buffer.
    """

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_is_last", "_sent_log", "_names")

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: Sequence[torch.Tensor],
        parameters: Sequence[torch.nn.Parameter],
        is_last: bool,
        sent_log: list[int] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        self._index = index
        self._names = tuple(names) if names is not None else None
        self._buffer = buffer
        self._gradients = list(gradients)
        self._parameters = list(parameters)
        self._is_last = is_last
        self._sent_log = sent_log

    def index(self) -> int:
        """Position of this bucket in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer (1-D)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Views into :meth:`buffer`, one per parameter, shaped like the parameter."""
        return self._gradients

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return self._parameters

    def parameter_names(self) -> tuple[str, ...] | None:
        """The parameters' names in the wrapped module, in bucket order (``None`` if not given).

        Not in torch's ``GradBucket``: stateful hooks use it to key their memory by parameter, so that it
        survives a change of bucket layout (see :mod:`lightning_ddpx.hooks.powersgd.remap`).
        """
        return self._names

    def is_last(self) -> bool:
        """Whether this is the last bucket launched in the iteration."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer seen by later calls (used by compression wrappers)."""
        self._buffer = tensor

    def __repr__(self) -> str:
        return (
            f"GradBucket(index={self._index}, numel={self._buffer.numel()}, "
            f"dtype={self._buffer.dtype}, parameters={len(self._parameters)}, is_last={self._is_last})"
        )


# A communication hook, torch's contract: ``hook(state, bucket) -> Future[Tensor]``. The one definition: the
# reducer, the hooks and the strategies import it from here (torch's own hooks are typed ``dist.GradBucket``,
# whose methods this class offers).
CommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


def payload_bytes(*tensors: torch.Tensor) -> int:
    """Bytes held by ``tensors``: what a collective over them sends, as counted in the statistics (a sparse
    tensor: its indices and values)."""
    total = 0
    for tensor in tensors:  # a loop, not sum() over a generator: called per bucket
        total += sparse_nnz_bytes(tensor) if tensor.is_sparse else tensor.numel() * tensor.element_size()
    return total


def record_bytes_sent(bucket: object, nbytes: int) -> None:
    """Count ``nbytes`` of collective payload sent for ``bucket`` in the reducer's statistics.

    Hooks call this for each collective they issue (the tensor's size, not the wire traffic of the
    algorithm). Only the hook knows what it sends (PowerSGD sends P and Q, not the bucket), so the reducer
    cannot measure it itself. A no-op for buckets that keep no statistics, e.g. torch's ``GradBucket``.
    ``list.append`` is atomic, so hooks may record from any thread.

    Example::

        >>> import torch.distributed as dist
        >>> from lightning_ddpx import record_bytes_sent
        >>> def mean_hook(state, bucket):
        ...     tensor = bucket.buffer().div_(dist.get_world_size())
        ...     record_bytes_sent(bucket, tensor.numel() * tensor.element_size())
        ...     return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])
        >>> model.register_comm_hook(None, mean_hook)  # doctest: +SKIP
        >>> # after a synchronised backward, model.comm_stats().bytes_sent holds the sum
    """
    log = getattr(bucket, "_sent_log", None)
    if log is not None:
        log.append(int(nbytes))


def sent_log_of(bucket: object) -> list[int] | None:
    """Where ``bucket`` records bytes sent, for wrappers that hand a re-made bucket to an inner hook."""
    return getattr(bucket, "_sent_log", None)
