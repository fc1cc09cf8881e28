"""Pickling and copying a wrapped model, as torch's DDP allows: only over the default process group.

A process group cannot be pickled, so the copy (``copy.deepcopy``, ``torch.save(model)``) leaves it behind
and takes the default group again when loaded; that is the same group only if the original averaged over
the default one, hence torch's rule, kept here with the reason and the way around it in each message. The
reducer (hooks on the original's parameters, a communication thread) stays behind too: the copy builds its
own at first use, so a comm hook, an overlapped optimizer and the statistics are registered again on it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist

from lightning_ddpx._compat.torch import default_group

__all__ = ["group_for_unpickling", "state_to_pickle"]


def state_to_pickle(state: dict[str, Any], process_group: dist.ProcessGroup) -> dict[str, Any]:
    """A shallow copy of a wrapped model's ``__dict__`` without its process group, which must be the
    default one (else ``RuntimeError`` naming the way around it)."""
    try:
        is_default = process_group == dist.group.WORLD or process_group == default_group()
    except (RuntimeError, ValueError):
        is_default = False
    if not is_default:
        raise RuntimeError(
            "lightning_ddpx.DistributedDataParallel: this model averages over a process group other than "
            "the default one, and process groups cannot be pickled or copied. Save or copy the wrapped "
            "module (model.module) instead, and wrap the copy. (torch: DDP Pickling/Unpickling are only "
            "supported when using DDP with the default process group. That is, when you have called "
            "init_process_group and have not passed process_group argument to DDP constructor)"
        )
    pickled = copy.copy(state)
    del pickled["process_group"]
    return pickled


def group_for_unpickling() -> dist.ProcessGroup:
    """The default group, which an unpickled model averages over (``RuntimeError`` if there is none)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "lightning_ddpx.DistributedDataParallel: unpickling a wrapped model needs the default process "
            "group, but torch.distributed is not initialised (torch's DDP requires it too). Call "
            "torch.distributed.init_process_group(...) first, or save and load the wrapped module instead: "
            "torch.save(model.module) / model.module.state_dict()."
        )
    return dist.group.WORLD
