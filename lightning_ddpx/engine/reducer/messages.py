"""The reducer's error messages: what went wrong, on which rank, with which parameter, and the fix."""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "backward_after_sync",
    "no_sync_while_reducing",
    "ready_twice",
    "unfinished_reduction",
    "unused_parameters",
]


def unused_parameters(rank: int, names: Sequence[str], indices: Sequence[int]) -> str:
    """``names`` (at ``indices`` among the reduced parameters) got no gradient; the message ends with torch's
    sentences, which code written for torch's DDP matches."""
    listed = ", ".join(repr(name) for name in names[:20])
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    return (
        f"lightning_ddpx: on rank {rank}, parameter(s) {listed}{more} received "
        "no gradient in this backward, so their buckets cannot be reduced. Either the forward did not use "
        "them or the loss does not depend on them. Pass find_unused_parameters=True to "
        "DistributedDataParallel (or use strategy 'ddpx_find_unused_parameters_true' in Lightning), "
        "or set requires_grad=False on parameters that are never trained. (torch: This error indicates that "
        "your module has parameters that were not used in producing loss. You can enable unused parameter "
        "detection by passing the keyword argument `find_unused_parameters=True` to "
        "`torch.nn.parallel.DistributedDataParallel`, and by making sure all `forward` function outputs "
        f"participate in calculating loss. Parameter indices which did not receive grad for rank {rank}: "
        f"{' '.join(str(i) for i in indices)}. Parameters which did not receive grad for rank {rank}: "
        f"{', '.join(names)})"
    )


def backward_after_sync(rank: int) -> str:
    return (
        f"lightning_ddpx (rank {rank}): a second backward through the outputs of a forward whose gradients "
        "were already synchronised (retain_graph=True), with no new forward through DistributedDataParallel. "
        "Its gradients would stay on this rank and the ranks would step with different gradients (torch's DDP "
        "lets this pass silently). Combine the losses into one backward, or run the extra backward inside "
        "no_sync() and synchronise on a later one."
    )


def no_sync_while_reducing(rank: int) -> str:
    return (
        f"lightning_ddpx (rank {rank}): no_sync() was entered while this rank's backward is already "
        "reducing gradients (from a gradient hook or a backward callback). This rank has already "
        "started reducing buckets, so the other ranks would wait for the rest of them and fall out of "
        "step. Enter no_sync() before the forward whose backward should not synchronise: whether a "
        "backward synchronises is decided when its forward runs."
    )


def ready_twice(name: str, find_unused_parameters: bool) -> str:
    if find_unused_parameters:
        return (
            f"lightning_ddpx: parameter {name!r} received a gradient after it was marked unused: it is not "
            "reachable from the outputs that forward() returned, yet the loss depends on it. Return every "
            "tensor the loss depends on from forward()."
        )
    return (
        f"lightning_ddpx: parameter {name!r} received a gradient twice in one synchronised iteration "
        "(backward ran more than once after one forward). Run the extra backward passes inside no_sync(), "
        "or combine the losses into one backward."
    )


def unfinished_reduction(unlaunched: Sequence[int]) -> str:
    return (
        "lightning_ddpx: the previous backward started synchronising gradients but never finished "
        f"(buckets not launched: {list(unlaunched)}). This happens when backward raised or was "
        "interrupted. Ranks may now be out of step; restart from a checkpoint."
    )
