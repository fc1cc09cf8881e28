"""Parameters whose ``requires_grad`` changes after wrapping: they join (or leave) the reduction.

The reducer puts gradient hooks on, and plans buckets for, the parameters that require gradients. The
standard fine-tuning schedule (Lightning's ``BackboneFinetuning``, a loop that unfreezes a backbone after a
few epochs) flips ``requires_grad`` later. torch's DDP then trains an unfrozen parameter on each rank without
ever averaging it -- the replicas diverge silently -- and fails with "Expected to have finished reduction"
when one is frozen. Here every synchronising forward compares the flags with those the reducer was built
for (one pass over the parameters, no communication); when they changed, the ranks compare their new sets
(one ``all_gather``) and the reducer adopts the new set (:meth:`Reducer.adopt_params
<lightning_ddpx.engine.reducer.reducer.Reducer.adopt_params>`), so the parameter is averaged from this very step,
identically on every rank. Gradients it accumulated meanwhile (``no_sync`` steps) are averaged with it.

Change ``requires_grad`` on every rank before the same forward (callbacks and training loops do): a rank
that changed it alone enters the comparison while the others enter their first bucket's reduction, and the
collectives do not match (a hang report names the comparison it waits in).
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.buckets.sparse import expects_sparse_gradients

if TYPE_CHECKING:
    from lightning_ddpx.engine.reducer.reducer import Reducer

__all__ = ["TrainableSet"]

log = logging.getLogger(__name__)
_requires_grad = attrgetter("requires_grad")


class TrainableSet:
    """The module's parameters and which of them the reducer currently reduces (``requires_grad``)."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], unused_allowed: bool = False) -> None:
        self.named = list(named)
        self._params = [p for _, p in self.named]
        self.flags = self._current()
        # find_unused_parameters: a reduced parameter frozen later is one more unused parameter (its gradient
        # left alone when no rank used it), so freezing alone needs no new plan; only newcomers do. That keeps
        # toggle_optimizer (GAN-style manual optimisation, which flips requires_grad every step) cheap.
        self.unused_allowed = unused_allowed
        self.pending_layout: dict[str, Any] | None = None  # a loaded layout for parameters frozen now

    def _current(self) -> bytes:
        return bytes(map(_requires_grad, self._params))  # once per synchronising forward: C-level loop

    def changed(self) -> bool:
        """Whether the reducer must take up new flags: some parameter's ``requires_grad`` differs from what it
        reduces (with ``unused_allowed``: some parameter it does not reduce became trainable). No collective."""
        current = self._current()
        if current == self.flags:
            return False
        if self.unused_allowed:
            return any(now > before for now, before in zip(current, self.flags))
        return True

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for (name, p), flag in zip(self.named, self.flags) if flag]

    def agree(
        self, process_group: dist.ProcessGroup, device: torch.device, step: int
    ) -> list[tuple[str, nn.Parameter]]:
        """Collective: adopt the current flags if every rank has the same ones, else raise on every rank.
        Returns the new trainable ``(name, parameter)`` list."""
        current = self._current()
        flags = torch.tensor(list(current), dtype=torch.int32, device=device)
        parts = [torch.empty_like(flags) for _ in range(dist.get_world_size(process_group))]
        dist.all_gather(parts, flags, group=process_group)
        table = [bytes(part.cpu().tolist()) for part in parts]
        if any(row != table[0] for row in table):
            raise RuntimeError(self._disagreement_message(table, process_group, step))
        old, self.flags = self.flags, current
        if not any(current):
            raise ValueError(
                "lightning_ddpx.DistributedDataParallel: every parameter now has requires_grad=False, so there is "
                "nothing to synchronise in this backward. Keep at least one parameter trainable, or run the "
                "forward under torch.no_grad()."
            )
        log.debug(
            "lightning_ddpx: requires_grad changed before step %d: %s", step + 1, self._describe(old, current)
        )
        return self.trainable()

    def adopt_change(
        self,
        reducer: Reducer,
        module: nn.Module,
        process_group: dist.ProcessGroup,
        device: torch.device,
        inside_join: bool,
    ) -> None:
        """Collective, after :meth:`changed`: the ranks agree on the new set (:meth:`agree`) and ``reducer``
        reduces it from this backward on; a saved layout kept for these parameters is installed."""
        step, rank = reducer.iterations_synced, dist.get_rank(process_group)
        if inside_join:
            raise RuntimeError(
                f"lightning_ddpx (rank {rank}): requires_grad changed on some parameter inside join() "
                f"(before synchronised step {step + 1}); ranks that already joined cannot take part in re-planning "
                "the buckets. Freeze or unfreeze parameters before entering join() (e.g. at the start of an "
                "epoch), or outside the uneven-inputs loop."
            )
        with waiting_for(
            f"every rank to compare its trainable parameters (requires_grad changed before synchronised step "
            f"{step + 1})",
            process_group,
        ):
            trainable = self.agree(process_group, device, step)
            params = [p for _, p in trainable]
            names = [name for name, _ in trainable]
            reducer.adopt_params(params, names, expects_sparse_gradients(module, params))
        layout, self.pending_layout = self.pending_layout, None
        if layout is not None and set(layout["parameter_order"]) == set(names):
            reducer.load_order_state(layout)  # a saved layout waiting for these parameters

    def keeps_layout_for_later(self, state: dict[str, Any]) -> bool:
        """Whether a saved bucket layout names parameters that are frozen now: then it is kept, and installed
        when exactly its parameters are trainable (:meth:`adopt_change`)."""
        names = set(state["parameter_order"])
        trainable = {name for name, _ in self.trainable()}
        if names != trainable and names <= {name for name, _ in self.named}:
            self.pending_layout = state
            return True
        return False

    def _describe(self, old: bytes, new: bytes) -> str:
        joined = [name for (name, _), a, b in zip(self.named, old, new) if b and not a]
        left = [name for (name, _), a, b in zip(self.named, old, new) if a and not b]
        return f"now reduced: {_few(joined)}; no longer reduced: {_few(left)}"

    def _disagreement_message(self, table: list[bytes], process_group: dist.ProcessGroup, step: int) -> str:
        ranks = dist.get_process_group_ranks(process_group)
        first = next(i for i in range(len(self.named)) if len({row[i] for row in table}) > 1)
        by_rank = {ranks[r]: bool(row[first]) for r, row in enumerate(table)}
        return (
            f"lightning_ddpx: requires_grad changed after wrapping, before synchronised step {step + 1}, but not "
            f"alike on every rank: parameter {self.named[first][0]!r} has requires_grad by rank {by_rank}. The "
            "ranks would reduce different parameters and their replicas would diverge. Freeze or unfreeze "
            "parameters on every rank before the same forward (a Lightning callback or the same line of the "
            "training loop on every rank)."
        )


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
