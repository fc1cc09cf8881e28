"""Every rank's own weights and optimizer state in the checkpoint, while post-local SGD lets them differ.

Lightning and Fabric write rank 0's model and optimizer state only: with data parallelism every rank holds
the same. Not so with post-local SGD: after ``start_localSGD_iter`` each replica takes its own steps between
model averages, and even right after an average the optimizer states (momentum, Adam moments) still differ.
A resume from rank 0's copy alone would restart every rank from rank 0's replica -- a different run.

So while replicas may differ, the strategies gather each rank's ``{name: state}`` (the model's state dict,
the optimizers' states) into the checkpoint, under :data:`REPLICAS_KEY`, as a list indexed by rank; on
resume each rank takes its own entry instead of rank 0's. The checkpoint grows by (world size - 1) times
the model and optimizer state (rank 0's entry is empty: its state is the checkpoint's main one); tensors
are moved to the CPU first and everything loads with ``weights_only=True``. A checkpoint written with another world size cannot be split this way: every rank then resumes from rank
0's replica, with a warning.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_ddpx.engine.agreement.errors import waiting_for

__all__ = ["REPLICAS_KEY", "gather_replicas", "replica_for_rank", "replicas_may_differ"]

REPLICAS_KEY = "lightning_ddpx_replicas"


def replicas_may_differ(hook_state: Any, averaging: bool) -> bool:
    """Whether post-local SGD has started, so that ranks may hold different weights or optimizer state."""
    if not averaging:
        return False
    differ = getattr(hook_state, "replicas_differ", None)  # DiLoCo: from the first inner step on
    if isinstance(differ, bool):
        return differ
    start = getattr(hook_state, "start_localSGD_iter", None)
    return start is not None and getattr(hook_state, "iter", 0) >= start


def gather_replicas(
    replica: dict[str, Any], group: Optional[dist.ProcessGroup] = None
) -> Optional[list[Any]]:
    """Every rank's ``replica`` (moved to the CPU), as a list on rank 0 of ``group``; ``None`` elsewhere.
    Rank 0's own entry is ``None``: its weights and optimizer state are the checkpoint's main ones.
    A collective: every rank must call it."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    replica = None if rank == 0 else move_data_to_device(replica, torch.device("cpu"))
    gathered: Optional[list[Any]] = [None] * world_size if rank == 0 else None
    with waiting_for(
        "every rank's own weights and optimizer state (post-local SGD), gathered to write a checkpoint", group
    ):
        dist.gather_object(
            replica, gathered, dst=dist.get_global_rank(group or dist.group.WORLD, 0), group=group
        )
    return gathered


def replica_for_rank(
    replicas: Any, rank: int, world_size: int, averaging: bool = True
) -> Optional[dict[str, Any]]:
    """This rank's entry of a checkpoint's replicas, or ``None``: rank 0 (whose replica is the checkpoint's
    main state), no replicas, replicas of another world size or a run without model ``averaging`` (those
    two with a warning)."""
    if replicas is None:
        return None
    if not averaging:
        rank_zero_warn(
            "lightning_ddpx: the checkpoint holds every rank's own weights from post-local SGD, but this run "
            "does not average models, so its replicas must start equal: every rank resumes from rank 0's "
            "weights and optimizer state. Configure post-local SGD again to continue each replica exactly."
        )
        return None
    if not isinstance(replicas, list) or len(replicas) != world_size:
        count = len(replicas) if isinstance(replicas, list) else type(replicas).__name__
        rank_zero_warn(
            f"lightning_ddpx: the checkpoint holds the post-local SGD replicas of {count} ranks, but this run has "
            f"{world_size}; every rank resumes from rank 0's weights and optimizer state (as after a model "
            "average). Resume with the same number of processes to continue each replica exactly."
        )
        return None
    return replicas[rank]
