"""Healing newcomers: a live peer's state to each of them, then every replica proved equal.

What travels is :meth:`Healer.use_state`'s choice (the bare module's :meth:`FaultTolerance.state_dict
<lightning_ddpx.fault.manager.FaultTolerance.state_dict>`; for the Trainer a whole Lightning checkpoint), with
the hook's shared state, serialised once here; how it travels is a
:class:`~lightning_ddpx.fault.transport.StateTransport`'s.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.replica_check import verify_replicas
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.fault.membership import Generation
from lightning_ddpx.fault.transport import BroadcastTransport, StateTransport

__all__ = ["Healer", "source_rank"]


def source_rank(generation: Generation) -> int:
    """The rank that sends a newcomer its state: the lowest-ranked live peer (rank 0 at the start)."""
    return generation.rank_of(min(generation.previous or generation.members[:1]))


class Healer:
    """What a newcomer receives, how it loads it, and the proof that the heal worked."""

    def __init__(
        self,
        dump: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
        hook_shared: Callable[[], dict[str, Any] | None],
        load_hook_shared: Callable[[dict[str, Any] | None], None],
        transport: StateTransport | None = None,
    ) -> None:
        self._dump, self._load = dump, load
        self._default_load = load  # a custom one may need more than weights_only (see _decode)
        self._hook_shared, self._load_hook_shared = hook_shared, load_hook_shared
        self.transport: StateTransport = transport if transport is not None else BroadcastTransport()

    def use_state(self, dump: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """``dump()`` runs on the live peer that sends, ``load(state)`` on each newcomer."""
        self._dump, self._load = dump, load

    def transfer(self, generation: Generation, uid: str) -> int:
        """The source's state to the newcomers of ``generation`` (every member calls it); the newcomers
        load it. Returns its size in bytes."""
        source = source_rank(generation)
        if generation.rank_of(uid) == source:
            payload = self._encode()
            self.transport.send(payload, source)
            return len(payload)
        payload = self.transport.receive(source)
        if uid in generation.newcomers:
            self._decode(payload)
        return len(payload)

    def verify(self, model: DistributedDataParallel, generation: Generation) -> None:
        """Prove the heal: every member's replica bit-identical (parameters and buffers), and the hook's
        shared state (PowerSGD's warm start, DiLoCo's anchors and outer momentum) identical on every member.
        With a hook that averages parameters (DiLoCo, post-local SGD) the replicas differ between averages by
        design, and the Trainer admits at an epoch's start: the newcomers are then proved copies of the peer
        that sent them its replica. Every member decides alike (from the generation and the hook)."""
        among = None
        if model.parameter_averaging is not None:
            among = [source_rank(generation)] + [generation.rank_of(uid) for uid in generation.newcomers]
        if model.broadcast_buffers:
            # Buffers a forward updates (BatchNorm's running statistics) differ between the members after
            # every step, as under torch's DDP, until the next forward broadcasts one rank's: do it now,
            # from the peer the newcomers copied, so that the check below compares what will train.
            model.synced_buffers.broadcast(dist.group.WORLD, source_rank(generation))
        model.verify_replicas(buffers=True, what="after a newcomer was healed", among=among)
        shared = named_tensors("the hook's shared state", self._hook_shared())
        if shared:
            verify_replicas(
                shared, dist.group.WORLD, model.synchronised_steps, what="after a newcomer was healed"
            )

    def _encode(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"state": self._dump(), "hook": self._hook_shared()}, buffer)
        return buffer.getvalue()

    def _decode(self, data: bytes) -> None:
        # a custom state (a Lightning checkpoint) may hold objects weights_only refuses; it comes from a peer
        # of the same run, as trusted as a checkpoint the run wrote
        default = self._load == self._default_load
        payload = torch.load(io.BytesIO(data), weights_only=default)
        self._load_hook_shared(payload["hook"])
        self._load(payload["state"])


def named_tensors(prefix: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors and numbers in a (nested) state dict, named by their path, in a fixed order: what the
    replica check compares. Strings and ``None`` carry no training state and are left out."""
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, (bool, int)):
        return [(prefix, torch.tensor(int(value), dtype=torch.int64))]
    if isinstance(value, float):
        return [(prefix, torch.tensor(value, dtype=torch.float64))]
    items: list[tuple[Any, Any]] = []
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: str(item[0]))
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    return [named for key, item in items for named in named_tensors(f"{prefix}[{key!r}]", item)]
