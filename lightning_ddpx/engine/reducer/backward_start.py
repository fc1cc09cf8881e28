"""Start a synchronised backward from the outputs of forward, in the outermost backward.

The reducer must queue its end-of-backward callback (``_finalize``) on the graph task of the user's own
``loss.backward()``. Queued from the first gradient hook, it lands on whichever graph task produced that
gradient: with reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``)
that can be the nested backward of one checkpointed block, which ends while the other blocks' gradients
are still to come. So a pre-hook goes on the autograd node of each of forward's outputs: those nodes run
first in the outer backward (everything forward computed lies below them) and the first of them starts the
reduction there. torch's DDP reaches the same point with its ``_DDPSink`` function; a pre-hook leaves the
outputs as they are (a custom function's outputs could no longer be modified in place).

Not every backward that reaches the outputs writes the parameters' gradients. ``torch.autograd.grad`` of
the inputs (a gradient penalty: WGAN-GP, R1) runs through them and accumulates nothing; and when every
parameter sits behind a reentrant checkpoint, the outer backward accumulates none of them itself (the
nested backwards do). Then the reducer only *claims the end* of the backward (:meth:`BackwardStart.claim_end`):
the first gradient, if one arrives, starts the reduction, and the end of that outer backward finalizes it;
a backward that produced no gradient leaves the reducer armed for the next one, as torch's DDP does.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_ddpx._compat.torch import queue_backward_callback
from lightning_ddpx.engine.reducer.reachability import iter_tensors
from lightning_ddpx.engine.weak_calls import weakly

__all__ = ["BackwardStart"]


class BackwardStart:
    """The pre-hooks on the last synchronising forward's outputs, and whether the end of the backward that
    reached them is claimed."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self.end_claimed = False

    def attach(self, outputs: Any, on_reached: Callable[[], None]) -> None:
        """Call ``on_reached()`` when backward reaches any tensor of ``outputs`` (tensors inside lists, tuples,
        dicts and dataclasses). Outputs without an autograd node (a parameter returned as is) add nothing;
        then the reduction starts from the first gradient hook instead."""
        self.remove()
        nodes = {tensor.grad_fn for tensor in iter_tensors(outputs) if tensor.grad_fn is not None}
        # held weakly: the hooks stay on the outputs after the iteration, and must not keep a reducer (its
        # threads) alive once its module is gone
        reached = weakly(on_reached)
        self._handles = [node.register_prehook(lambda grad_outputs: reached()) for node in nodes]

    def claim_end(self, at_end: Callable[[], None]) -> None:
        """Run ``at_end()`` when the running backward ends (its graph task, not a nested one)."""
        self.end_claimed = True

        def end() -> None:
            self.end_claimed = False
            at_end()

        queue_backward_callback(end)

    def iteration_ended(self, succeeded: bool) -> None:
        """A synchronised backward ended. After a success the outputs keep their pre-hooks until the next
        forward, so that a second backward through them is seen (and refused by the reducer); after a
        failure they go."""
        self.end_claimed = False
        if not succeeded:
            self.remove()

    def remove(self) -> None:
        """Take the pre-hooks off (an output node may outlive its iteration); a claim is void from now on
        (the backward it was made in failed before its end, or the iteration is over)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.end_claimed = [], False
