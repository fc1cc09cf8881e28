"""Which bucket layout the reducer uses, and when it changes.

torch's rule: at construction, buckets are planned along parameter order and launched in reverse (one
bucket per dtype and device unless ``find_unused_parameters``; see
:func:`~lightning_ddpx.engine.buckets.plan.plan_initial_buckets`); the first synchronised backward (the second
with ``static_graph``) records the order in which gradients became ready, and the next synchronising
forward re-plans along it, so a bucket's gradients arrive together. With ``find_unused_parameters`` alone
torch never re-plans, and neither does this. Every rank must hold the same layout (the collectives differ
otherwise), so the re-plan follows one rank's observed order, broadcast to all. A checkpoint can carry a
layout, so a resumed run reduces exactly the buckets the saved run had.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.buckets.plan import plan_buckets, plan_initial_buckets
from lightning_ddpx.engine.buckets.storage import BucketLayout

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
        find_unused_parameters: bool,
        static_graph: bool,
    ) -> None:
        self.params, self.names = list(params), list(names)
        self.sparse_gradients = list(sparse_gradients)
        self.first_cap_bytes, self.cap_bytes = first_cap_bytes, cap_bytes
        # torch: one bucket until the rebuild, which only comes where the ready order is worth following
        self.one_bucket_first = static_graph or not find_unused_parameters
        # the ready order of a synchronised backward, while it is recorded (None: not recording). torch
        # records the first one, or with static_graph the second (the first only counts gradients).
        self.recording: list[int] | None = [] if self.one_bucket_first and not static_graph else None
        self._record_second = static_graph
        self._observed: list[int] = []
        self.rebuild_pending = False
        self.rebuilt = False  # the layout follows an observed ready order (torch's has_rebuilt_buckets)

    @property
    def settled(self) -> bool:
        """No rebuild is to come: the layout was rebuilt, or it never will be (torch: ``find_unused_parameters``
        without ``static_graph``)."""
        return self.rebuilt or (
            self.recording is None and not self.rebuild_pending and not self._record_second
        )

    def allow_rebuild(self) -> None:
        """``static_graph`` was set after construction (torch's ``_set_static_graph``, before the first
        iteration): record the second synchronised backward's ready order and rebuild after it."""
        if not self.rebuilt and not self.rebuild_pending:
            self.recording, self._record_second = None, True

    def initial_layout(self, small_last_bucket: bool) -> BucketLayout:
        """The layout before any rebuild: torch's (see the module's docstring). With ``small_last_bucket``
        (the optimizer overlap, ours) the caps apply along reverse parameter order instead, so that the
        parameters ready last get a small bucket of their own from the first step."""
        if small_last_bucket:
            return self.layout(list(reversed(range(len(self.params)))), small_last_bucket=True)
        params = self.params
        specs = plan_initial_buckets(
            [p.numel() for p in params],
            [p.dtype for p in params],
            [p.device for p in params],
            self.first_cap_bytes,
            self.cap_bytes,
            self.one_bucket_first,
            self.sparse_gradients if any(self.sparse_gradients) else None,
        )
        return BucketLayout(specs, params, self.names)

    def layout(self, order: Sequence[int], small_last_bucket: bool) -> BucketLayout:
        """The buckets along ``order`` (a ready order); ``small_last_bucket``: capped like the first one (the
        optimizer overlap, which cannot hide the last bucket's update)."""
        params = self.params
        specs = plan_buckets(
            [p.numel() for p in params],
            [p.dtype for p in params],
            [p.device for p in params],
            order,
            self.first_cap_bytes,
            self.cap_bytes,
            self.first_cap_bytes if small_last_bucket else None,
            self.sparse_gradients if any(self.sparse_gradients) else None,
        )
        return BucketLayout(specs, params, self.names)

    def iteration_ended(self, succeeded: bool) -> None:
        """A synchronised backward ended: a complete recorded order makes the next forward re-plan."""
        if self.recording is None:
            if succeeded and self._record_second:  # static_graph: its first backward ended
                self.recording, self._record_second = [], False
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
        self.rebuild_pending, self.rebuilt = False, True
        return order.tolist()

    def finish_rebuilding(self) -> None:
        """No re-plan from now on (a saved, already rebuilt layout was loaded; a joined rank took part in
        the active ranks' rebuild)."""
        self.recording, self.rebuild_pending, self.rebuilt = None, False, True
        self._record_second = False

    def order_state(self, layout: BucketLayout) -> dict[str, Any]:
        """``layout`` as plain values: parameter names in buffer order, and whether it was rebuilt. With a
        rebuild pending, the layout the next forward installs (so a resumed run reduces the same buckets at
        the same step as an uninterrupted one)."""
        if self.rebuild_pending:
            return {"parameter_order": [self.names[i] for i in self._observed], "rebuilt": True}
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
