"""torch's optimizer in backward (``torch.distributed.optim._apply_optimizer_in_backward``) on our module.

That function gives each parameter its own optimizers and a hook on its gradient accumulator that steps them
as soon as the gradient is accumulated, then sets ``grad`` to ``None``. Under data parallelism that gradient
is the local one, not the average: left alone, every rank would step with its own gradient and the replicas
would drift apart from the first step, silently. torch's DDP takes those hooks off at its first forward and
steps the optimizers after each bucket's all-reduce instead (on CUDA only: on a CPU-only build its hook
needs an accelerator). Ours does the same on any device: at the first forward (and whenever such
optimizers appear later, at the next forward) the parameters' own hooks are removed, the
buckets are summed and divided by the world size as torch's hook for this path does, each parameter's
optimizers step with the average once it is written back, and its ``grad`` is ``None`` after backward.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx._compat.torch import in_backward_optimizers
from lightning_ddpx.engine.buckets.grad_bucket import (
    GradBucket,
    collectives_issued_on_call,
    payload_bytes,
    record_bytes_sent,
)
from lightning_ddpx.engine.transport.transports import CommHook, Transport, hook_name

if TYPE_CHECKING:
    from lightning_ddpx.engine.reducer.reducer import Reducer

__all__ = [
    "InBackwardOptimizers",
    "refuse_combination",
    "registrations",
    "sum_then_average_hook",
    "take_over",
]


# Looked up, never imported: importing torch.distributed.optim costs time and warnings (torch.jit), and
# nothing can have been hooked by a module nobody imported.
_MODULE = "torch.distributed.optim.apply_optimizer_in_backward"


def _handle_map() -> Any:
    module = sys.modules.get(_MODULE)
    return None if module is None else module.param_to_optim_hook_handle_map


def registrations() -> int:
    """How many parameters ``_apply_optimizer_in_backward`` has hooked in this process (one look-up: the
    module re-scans its parameters only when this changes)."""
    handles = _handle_map()
    return 0 if handles is None else len(handles)


@collectives_issued_on_call
def sum_then_average_hook(process_group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
    """torch's arithmetic for optimizers in backward: the sum all-reduced, then divided by the world size."""
    buffer = bucket.buffer()
    record_bytes_sent(bucket, payload_bytes(buffer))
    size = dist.get_world_size(process_group)
    future = dist.all_reduce(buffer, group=process_group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0].div_(size))


class InBackwardOptimizers:
    """The parameters whose optimizers step at the end of each synchronised backward, with the average."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)

    def step_and_release(self) -> None:
        """Step every parameter's optimizers (each updates only its parameter), then drop the gradients,
        as torch's DDP does at the end of backward."""
        for param in self.params:
            for optimizer in in_backward_optimizers(param):
                optimizer.step()
        for param in self.params:
            param.grad = None


def refuse_combination(subject: str, what: str) -> NoReturn:
    """The one error for optimizers in backward together with ``what`` (a comm hook, the optimizer overlap);
    ``subject``: which parameters have them."""
    raise ValueError(
        f"lightning_ddpx: {subject} optimizers in backward (torch.distributed.optim._apply_optimizer_in_backward), "
        "which step each parameter with its averaged gradient through a summing all-reduce of their own; they "
        f"cannot be combined with {what}. Drop one of the two (torch's DDP allows only its allreduce with "
        "optimizers in backward)."
    )


def take_over(
    reducer: Reducer, process_group: dist.ProcessGroup, device: torch.device, registered_hook: CommHook | None
) -> None:
    """If some of ``reducer``'s parameters have optimizers in backward: refuse a registered hook or the
    optimizer overlap (before changing anything), else remove ``_apply_optimizer_in_backward``'s hooks, sum
    the buckets through :func:`sum_then_average_hook` and have the reducer step the optimizers after
    backward. Every rank calls it at the same forward (the transport is part of the settings they compare)."""
    members = [p for p in reducer.params if in_backward_optimizers(p)]
    handles = _handle_map()
    if not members or handles is None:
        return
    if registered_hook is not None or reducer.overlap is not None:
        first = reducer.names[reducer.index_of[id(members[0])]]
        refuse_combination(
            f"parameter {first!r} (and {len(members) - 1} more) has",
            f"the communication hook {hook_name(registered_hook)}"
            if registered_hook is not None
            else "overlap_optimizer_with (overlap_optimizer=True)",
        )
    for param in members:
        for handle in handles.get(param, []):
            handle.remove()
        handles[param] = []  # removed: a later look-up finds nothing left to remove
    if reducer.transport.hook is not sum_then_average_hook:
        reducer.use_transport(Transport(sum_then_average_hook, process_group, device))
    reducer.in_backward = InBackwardOptimizers(members)
