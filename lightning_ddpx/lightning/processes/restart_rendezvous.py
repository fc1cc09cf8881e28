"""The default process group under torchrun's restarts: created on this round's keys only.

Since torch 2.5 torchrun's workers share the agent's TCP store (``TORCHELASTIC_USE_AGENT_STORE=True``), and
that store outlives a round: when a rank dies and torchrun restarts every process, the keys of the killed
round are still there. torch's ``env://`` creation puts the default group's keys under the same names in
every round (``default_pg/0/...``), so the restarted round's gloo reads the killed round's listening
addresses: it connects to a port nobody listens on (``Gloo connectFullMesh failed ... Connection refused``)
or waits in ``connectFullMesh`` until the group's timeout (Lightning's default: 30 minutes), at random
(pytorch/pytorch#135712; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is torch's workaround, which users do not
know to set). torch's own DDP strategy has the same failures.

:func:`create_default_group` makes the strategy immune by itself: under torchrun's shared store it creates
the default group on a client of that store under a prefix of this restart round
(:func:`~lightning_ddpx.engine.agreement.launch_round.round_prefix`), so a round reads only the addresses
its own ranks wrote, and a process of an old round can never complete a new round's handshake. Elsewhere it
does nothing and the strategy creates the group as Lightning does. Its one wait (every rank's address, in
gloo's or NCCL's connection) is bounded by the strategy's ``timeout`` and fails as a named error on every
rank that waited.

WARNING: an elastic membership change that restarts the workers without counting a restart (a node joining
``--nnodes=MIN:MAX``) keeps the restart count; the world size is in the prefix too, so only a change back to
a world size an earlier round of the same count had would meet that round's keys.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import CommunicationError
from lightning_ddpx.engine.agreement.launch_round import launch_round, round_prefix

__all__ = ["create_default_group", "shares_torchrun_store"]

log = logging.getLogger(__name__)


def shares_torchrun_store() -> bool:
    """Whether torchrun started this process with its agent's store shared by every round."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"


def create_default_group(
    environment: Any, backend: str, timeout: timedelta, device: torch.device | None = None
) -> bool:
    """Create the default group on this round's keys when torchrun shares its store; returns whether it
    did (``False``: not under torchrun's shared store, or a group exists already; create it as usual).

    ``environment``: the strategy's cluster environment (torchrun's address, port, rank and world size);
    ``device``: the group's bound device (a CUDA device for NCCL; ``None`` or a CPU device: none)."""
    if dist.is_initialized() or not shares_torchrun_store():
        return False
    rank, world_size = environment.global_rank(), environment.world_size()
    prefix = round_prefix(f"default_pg/world{world_size}")
    address = f"{environment.main_address}:{environment.main_port}"
    log.info(
        f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size} (keys {prefix})"
    )
    try:
        client = dist.TCPStore(
            environment.main_address,
            environment.main_port,
            world_size=world_size,
            is_master=False,  # torchrun's agent hosts it
            timeout=timeout,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(prefix, client),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device is not None and device.type != "cpu" else None,
        )
    except (RuntimeError, ValueError) as error:  # DistError and the backends' errors are RuntimeErrors
        raise CommunicationError(
            f"lightning_ddpx (rank {rank}): creating the default process group of torchrun's restart round "
            f"{launch_round()} ({world_size} ranks, torchrun's store at {address}, keys under {prefix!r}) failed "
            f"while waiting for every rank's {backend} address: a rank of this round did not start, died, or "
            f"cannot reach the others within {timeout.total_seconds():.0f} s. Check the other ranks' logs; to wait "
            "longer pass timeout=datetime.timedelta(...) to DDPXStrategy. Underlying error: "
            f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
        ) from error
    return True
