"""torch's ``device_ids`` / ``output_device`` / ``dim`` arguments, with torch's rules, checked before any traffic.

``DDP(model, device_ids=[local_rank])`` is the line most GPU scripts wrap their model with. torch's rules:

- ``device_ids`` holds at most one device; for a module on one GPU it names that GPU, and forward moves its
  inputs there (``inputs_to_device``); ``None`` or ``[]`` leave inputs where they are.
- for a module on the CPU (or one spread over several devices, which lightning_ddpx refuses anyway)
  ``device_ids`` and ``output_device`` must be left unset.
- ``output_device`` defaults to ``device_ids[0]``; torch keeps it for its API only (its single-device DDP
  returns outputs where the module made them), and so do we. ``dim`` only splits inputs across the devices
  of one process, which neither torch nor lightning_ddpx does any more: it is kept, unused.

Where torch would only fail at the first forward (``device_ids`` naming another GPU than the module's), we
fail at construction, saying which device to pass.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import torch

from lightning_ddpx._compat.torch import device_index

__all__ = ["Placement", "resolve_placement", "side_stream_copies"]

DeviceLike = int | str | torch.device


class Placement(NamedTuple):
    device_ids: list[int] | None  # torch's meaning: the one device of the module, or None
    output_device: int | None  # kept for torch's API; outputs stay where the module produced them
    input_device: torch.device | None  # where forward moves its inputs to (None: leave them)


def resolve_placement(
    device_ids: Sequence[DeviceLike] | None, output_device: DeviceLike | None, module_device: torch.device
) -> Placement:
    """torch's ``device_ids`` / ``output_device`` for a module whose parameters are all on ``module_device``."""
    if device_ids is not None and (
        isinstance(device_ids, (str, bytes)) or not isinstance(device_ids, Sequence)
    ):
        raise TypeError(
            f"lightning_ddpx.DistributedDataParallel: device_ids must be a list of one device (e.g. "
            f"device_ids=[local_rank]) or None, got {device_ids!r} ({type(device_ids).__name__})."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            f"lightning_ddpx.DistributedDataParallel: device_ids={list(device_ids)!r} names several devices, but "
            "each process drives one device (torch's DDP refuses this too: device_ids can only be None or contain "
            "a single element.). Start one process per GPU and pass device_ids=[local_rank]."
        )
    if not device_ids or module_device.type == "cpu":
        if device_ids or output_device:  # torch's test: output_device=0 passes, as in torch
            raise ValueError(
                f"lightning_ddpx.DistributedDataParallel: device_ids={device_ids!r} / output_device={output_device!r} "
                f"name a device, but the module is on {module_device}. Leave both unset for a CPU module, or move "
                "the module to its GPU first: module.to(f'cuda:{local_rank}'). torch's DDP refuses this too "
                "(DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters { {module_device} }.)"
            )
        return Placement(None, None, None)
    index = device_index(device_ids[0])
    if module_device.index is not None and index != module_device.index:
        raise ValueError(
            f"lightning_ddpx.DistributedDataParallel: device_ids={list(device_ids)!r} names {module_device.type}:"
            f"{index}, but the module's parameters are on {module_device}; forward would move the inputs to "
            f"another device than the weights. Pass device_ids=[{module_device.index}], or move the module with "
            f"module.to('{module_device.type}:{index}') before wrapping it."
        )
    output = device_index(output_device if output_device is not None else device_ids[0])
    return Placement([index], output, torch.device(module_device.type, index))


def side_stream_copies() -> bool:
    """torch's switch for copying inputs on a side stream (``PYTORCH_DDP_USE_SIDE_STREAM``, default on)."""
    return os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
