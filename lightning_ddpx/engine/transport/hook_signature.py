"""Check a communication hook's signature at registration, as torch's DDP does, before any backward runs.

torch refuses a hook that is not callable (TypeError), or whose annotations say it takes something other
than a ``GradBucket`` or returns something other than a ``Future[Tensor]`` (ValueError); its tests match its
sentences, which our messages therefore contain verbatim. We accept what torch accepts and a little more that
is equally right: our own ``GradBucket`` or a base class (``object``), a bare ``Future``, ``Any``, and
annotations left as strings by ``from __future__ import annotations`` (torch compares those with the classes,
and so refuses them).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_ddpx.engine.buckets.grad_bucket import GradBucket
from lightning_ddpx.engine.transport.transports import hook_name

__all__ = ["check_comm_hook"]

_EMPTY = inspect.Parameter.empty


def check_comm_hook(hook: Any) -> None:
    """Raise torch's error type, with its sentence and ours, if ``hook`` cannot be a communication hook."""
    if not callable(hook):
        raise TypeError(
            f"lightning_ddpx: a communication hook must be callable, got {type(hook).__name__} "
            "(Communication hook must be callable.)"
        )
    signature = _signature(hook)
    if signature is None:
        return  # builtins without a signature: trust them
    try:
        signature.bind(object(), object())
    except TypeError:
        raise TypeError(
            f"lightning_ddpx: communication hook {hook_name(hook)} has signature {signature}, but hooks are called "
            "as hook(state, bucket) and must return a torch.futures.Future holding the reduced bucket tensor."
        ) from None
    bucket = _bucket_annotation(signature)
    if not _is_bucket_type(bucket):
        raise ValueError(
            f"lightning_ddpx: communication hook {hook_name(hook)} annotates its bucket as {_show(bucket)}, but "
            "it is given a torch.distributed.GradBucket (Communication hook: bucket annotation should be "
            "dist.GradBucket.). Fix the annotation, or remove it."
        )
    if not _is_future_type(signature.return_annotation):
        raise ValueError(
            f"lightning_ddpx: communication hook {hook_name(hook)} is annotated to return "
            f"{_show(signature.return_annotation)}, but a hook must return a future of the reduced bucket "
            "(Communication hook: return annotation should be torch.futures.Future[torch.Tensor].). Return "
            "e.g. dist.all_reduce(bucket.buffer(), async_op=True).get_future()."
        )


def _signature(hook: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError, AttributeError):  # a string annotation that does not resolve
        pass
    except ValueError:
        return None
    try:
        return inspect.signature(hook)
    except (TypeError, ValueError):
        return None


def _bucket_annotation(signature: inspect.Signature) -> Any:
    """The annotation of the parameter the bucket is passed to (the second positional one)."""
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return positional[1].annotation if len(positional) > 1 else _EMPTY


def _is_bucket_type(annotation: Any) -> bool:
    if annotation is _EMPTY or annotation is Any:
        return True
    if isinstance(annotation, str):
        return "GradBucket" in annotation or annotation in ("Any", "typing.Any")
    # the bucket's class or a base of it (``object``): what the hook is given satisfies the annotation
    return isinstance(annotation, type) and any(
        issubclass(c, annotation) for c in (dist.GradBucket, GradBucket)
    )


def _is_future_type(annotation: Any) -> bool:
    if annotation is _EMPTY or annotation is Any:
        return True
    if isinstance(annotation, str):
        return "Future" in annotation
    origin = typing.get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, torch.futures.Future)


def _show(annotation: Any) -> str:
    return (
        annotation if isinstance(annotation, str) else getattr(annotation, "__qualname__", repr(annotation))
    )
