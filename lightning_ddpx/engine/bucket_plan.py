"""Which bucket layout the reducer uses, and when it changes.

torch's rule: buckets follow reverse parameter order at first; the first synchronised backward records
the order in which gradients became ready, and the next synchronising forward re-plans along it, so a
bucket's gradients arrive together. Every rank must hold the same layout (the collectives differ
otherwise), so the re-plan follows one rank's observed order, broadcast to all. A checkpoint can carry a
layout, so a resumed run reduces exactly the buckets the saved run had.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx.engine.bucketing import plan_buckets
from lightning_ddpx.engine.buckets import BucketLayout
from lightning_ddpx.engine.errors import waiting_for

__all__ = ["BucketPlanner"]


class BucketPlanner:
    """Plans layouts for one parameter list and tracks the observed gradient order that re-plans them."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        sparse_gradients: Sequence[bool],
        first_cap_bytes: int,
        cap_bytes: int,
    ) -> None:
        self.params, self.names = list(params), list(names)
        self.sparse_gradients = list(sparse_gradients)
        self.first_cap_bytes, self.cap_bytes = first_cap_bytes, cap_bytes
        # the ready order of the first synchronised backward, while it is recorded (then None)
        self.recording: list[int] | None = []
        self._observed: list[int] = []
        self.rebuild_pending = False

    def layout(self, order: Sequence[int], small_last_bucket: bool) -> BucketLayout:
        """The buckets along ``order``; ``small_last_bucket``: capped like the first one (the optimizer
        overlap, which cannot hide the last bucket's update)."""
        params = self.params
        specs = plan_buckets(
            [p.numel() for p in params], [p.dtype for p in params], [p.device for p in params], order,
            self.first_cap_bytes, self.cap_bytes, self.first_cap_bytes if small_last_bucket else None,
            self.sparse_gradients if any(self.sparse_gradients) else None,
        )  # fmt: skip
        return BucketLayout(specs, params, self.names)

    @property
    def rebuilt(self) -> bool:
        """The layout follows the observed gradient order (torch: rebuilt after the first iteration)."""
        return self.recording is None and not self.rebuild_pending

    def iteration_ended(self, succeeded: bool) -> None:
        """A synchronised backward ended: a complete recorded order makes the next forward re-plan."""
        if self.recording is None:
            return
        if succeeded and len(self.recording) == len(self.params):
            self._observed, self.recording = self.recording, None
            self.rebuild_pending = True
        else:
            self.recording = []

    def agreed_order(self, src: int, process_group: dist.ProcessGroup, device: torch.device) -> list[int]:
        """Collective: rank ``src``'s observed order, on every rank (a rank that joined before observing
        one only receives: same size, values overwritten)."""
        observed = self._observed
        order = torch.tensor(observed if len(observed) == len(self.params) else range(len(self.params)))
        order = order.to(torch.int64).to(device)
        with waiting_for(f"rank {src}'s gradient ready order to rebuild buckets", process_group):
            dist.broadcast(order, group=process_group, group_src=src)
        self.rebuild_pending = False
        return order.tolist()

    def finish_rebuilding(self) -> None:
        """No re-plan from now on (a saved, already rebuilt layout was loaded; a joined rank took part in
        the active ranks' rebuild)."""
        self.recording, self.rebuild_pending = None, False

    def order_state(self, layout: BucketLayout) -> dict[str, Any]:
        """``layout`` as plain values: parameter names in buffer order, and whether it was rebuilt."""
        return {"parameter_order": [self.names[i] for i in layout.parameter_order()], "rebuilt": self.rebuilt}

    def saved_order(self, state: dict[str, Any]) -> list[int]:
        """The parameter order of a layout saved by :meth:`order_state` (same parameters, by name)."""
        position = {name: i for i, name in enumerate(self.names)}
        names = list(state["parameter_order"])
        if sorted(names) != sorted(self.names):
            missing = sorted(set(self.names) - set(names))[:5]
            extra = sorted(set(names) - set(self.names))[:5]
            raise ValueError(
                "lightning_ddpx: the saved bucket layout is for other parameters "
                f"(missing here: {extra}, not in the saved layout: {missing}); it cannot be restored."
            )
        return [position[name] for name in names]
