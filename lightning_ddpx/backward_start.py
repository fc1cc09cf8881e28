"""Start a synchronised backward from the outputs of forward, in the outermost backward.

The reducer must queue its end-of-backward callback (``_finalize``) on the graph task of the user's own
``loss.backward()``. Queued from the first gradient hook, it lands on whichever graph task produced that
gradient: with reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``)
that can be the nested backward of one checkpointed block, which ends while the other blocks' gradients
are still to come. So forward's outputs pass through an identity autograd node; its backward runs first in
the outer backward (it is the root of everything forward computed) and starts the reduction there.
torch's DDP does the same with its ``_DDPSink``.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable, Mapping

import torch

__all__ = ["attach_backward_start"]


class _BackwardStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)  # views: no copy of (possibly large) outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def attach_backward_start(outputs: Any, callback: Callable[[], None]) -> Any:
    """``outputs`` with its tensors that require grad routed through one node calling ``callback`` first
    in backward. Containers are rebuilt (lists, tuples, named tuples, dicts, dataclasses); other objects
    are returned as they are, and then the reduction starts from the first gradient hook instead."""
    found: list[torch.Tensor] = []
    _map(outputs, lambda t: found.append(t) or t)
    if not found or not torch.is_grad_enabled():
        return outputs
    routed = iter(_BackwardStart.apply(callback, *found))
    return _map(outputs, lambda t: next(routed))


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.requires_grad else obj
    if isinstance(obj, list):
        return [_map(item, fn) for item in obj]
    if isinstance(obj, tuple):
        items = [_map(item, fn) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Mapping) and type(obj) in (dict,):
        return {key: _map(value, fn) for key, value in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _map(getattr(obj, f.name), fn) for f in fields(obj) if f.init})
    return obj
