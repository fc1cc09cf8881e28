"""Start a synchronised backward from the outputs of forward, in the outermost backward.

The reducer must queue its end-of-backward callback (``_finalize``) on the graph task of the user's own
``loss.backward()``. Queued from the first gradient hook, it lands on whichever graph task produced that
gradient: with reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``)
that can be the nested backward of one checkpointed block, which ends while the other blocks' gradients
are still to come. So a pre-hook goes on the autograd node of each of forward's outputs: those nodes run
first in the outer backward (everything forward computed lies below them) and the first of them starts the
reduction there. torch's DDP reaches the same point with its ``_DDPSink`` function; a pre-hook leaves the
outputs as they are (a custom function's outputs could no longer be modified in place).
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_ddpx.engine.graph import iter_tensors

__all__ = ["attach_backward_start"]


def attach_backward_start(outputs: Any, callback: Callable[[], None]) -> list[Any]:
    """Call ``callback()`` when backward reaches any tensor of ``outputs`` (tensors inside lists, tuples,
    dicts and dataclasses); return the hooks' handles, to remove them once the iteration is over (an output
    node may outlive it). Outputs without an autograd node (a parameter returned as is) add nothing; then
    the reduction starts from the first gradient hook instead."""
    nodes = {tensor.grad_fn for tensor in iter_tensors(outputs) if tensor.grad_fn is not None}
    return [node.register_prehook(lambda grad_outputs: callback()) for node in nodes]
