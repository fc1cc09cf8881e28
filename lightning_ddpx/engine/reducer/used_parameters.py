"""Which parameters received a gradient: on this rank, and on how many ranks (torch's used maps).

torch's reducer keeps a ``local_used_map`` (which parameters got a gradient on this rank since the last
synchronisation, ``no_sync()`` backwards included) and, with ``find_unused_parameters``, all-reduces it
after the last bucket into a ``global_used_map``: a parameter no rank used keeps its gradient untouched,
and one used only in a ``no_sync()`` micro-batch is still averaged. :class:`UsedParameters` is that pair;
the reducer marks it in its gradient hooks and the end of backward reads the counts
(:mod:`lightning_ddpx.engine.reducer.results_in_order`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.transport.cuda_streams import current_stream

if TYPE_CHECKING:
    from lightning_ddpx.engine.agreement.progress_board import ProgressBoard
    from lightning_ddpx.engine.reducer.static_graph import StaticGraph
    from lightning_ddpx.engine.transport.launcher import InlineLauncher, SequencedLauncher

__all__ = ["UsedParameters"]


def _all_reduce(tensor: torch.Tensor, process_group: dist.ProcessGroup) -> torch.futures.Future:
    return dist.all_reduce(tensor, group=process_group, async_op=True).get_future()


class UsedParameters:
    """``local[i]`` is 1 once parameter ``i`` received a gradient on this rank since the last
    synchronised backward. The map is one ``bytearray`` for the reducer's whole life (cleared in place), so
    the gradient hooks may hold it."""

    def __init__(self, count: int, used: Sequence[int] | None = None) -> None:
        self.local = bytearray(used if used is not None else count)

    def clear(self) -> None:
        """A synchronised backward ended: nothing is used since."""
        self.local[:] = bytes(len(self.local))

    def carried_over(
        self, old: Sequence[torch.nn.Parameter], new: Sequence[torch.nn.Parameter]
    ) -> UsedParameters:
        """The map for a new parameter list, each parameter keeping its mark (``no_sync`` gradients
        accumulated before ``requires_grad`` changed are still averaged)."""
        marked = {id(p) for p, used in zip(old, self.local) if used}
        return UsedParameters(len(new), [id(p) in marked for p in new])

    def launch_counts(
        self,
        process_group: dist.ProcessGroup,
        device: torch.device,
        launcher: InlineLauncher | SequencedLauncher,
        progress: ProgressBoard,
        iteration: int,
    ) -> torch.futures.Future:
        """Issue the all-reduce of the map (after the buckets, through their launcher, so every rank issues
        it in the same place); its result counts, per parameter, the ranks that used it."""
        progress.record("the used-parameter bitmap in iteration {}", iteration)
        bitmap = torch.tensor(list(self.local), dtype=torch.int32, device=device)
        # CUDA: issued with this (the copying) stream current, also on the communication thread
        return launcher.submit(_all_reduce, bitmap, process_group, stream=current_stream(device))

    @staticmethod
    def counts(
        launched: torch.futures.Future, process_group: dist.ProcessGroup, static: StaticGraph | None
    ) -> list[int]:
        """The counts :meth:`launch_counts` issued, waited for (a static graph records them: later
        iterations share no bitmap)."""
        with waiting_for("the used-parameter bitmap (find_unused_parameters)", process_group):
            counts = launched.wait()[0].tolist()
        if static is not None:
            static.record(counts)
        return counts
