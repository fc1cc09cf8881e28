"""How a newcomer's state travels from the live peer that sends it: behind :class:`StateTransport`.

The state is serialised once (:class:`~lightning_ddpx.fault.heal.Healer`); a transport only moves bytes, so
that another one -- a broadcast on a side group, a file on shared storage, a peer-to-peer copy -- changes
this room alone. Today's, :class:`BroadcastTransport`, broadcasts over the generation's default group: every
member takes part (its cost: the payload once through gloo's broadcast tree; measured in docs/benchmarks.md
by ``benchmarks/bench_fault_tolerance.py --sections heal``).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["BroadcastTransport", "StateTransport"]


class StateTransport(Protocol):
    """Moves one serialised state from rank ``source`` of the current generation to its newcomers. Every
    member of the generation calls exactly one of the two methods, at the same point: the source
    :meth:`send`, every other member :meth:`receive`."""

    def send(self, payload: bytes, source: int) -> None:
        """On rank ``source``: hand ``payload`` on."""
        ...

    def receive(self, source: int) -> bytes:
        """On every other member: the source's payload (a member that already holds the state may get it
        too, and discards it)."""
        ...


class BroadcastTransport:
    """The payload broadcast over the default process group: its size, then its bytes."""

    def send(self, payload: bytes, source: int) -> None:
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, source)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), source)

    def receive(self, source: int) -> bytes:
        size = torch.tensor([0], dtype=torch.int64)
        dist.broadcast(size, source)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, source)
        return data.numpy().tobytes()
