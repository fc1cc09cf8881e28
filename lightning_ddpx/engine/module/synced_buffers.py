"""The buffers a wrapped model keeps equal across ranks (BatchNorm's running statistics...).

torch's DDP finds them once, at construction, and broadcasts rank 0's before every synchronised forward
(``broadcast_buffers=True``). They are looked up through the (submodule, name) slots found then, rather
than by walking every submodule each step (what that walk cost: docs/benchmarks.md, "Per-parameter cost");
looking each up by name still follows a buffer replaced by assignment (e.g. ``module.to()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddpx.engine.agreement.consistency import broadcast_from
from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.profiling import label

__all__ = ["SyncedBuffers"]


class SyncedBuffers:
    """The buffers of ``module`` (each tensor once, in ``module.buffers()`` order), less those whose fully
    qualified name (its first, as ``named_buffers()`` gives it) is ``ignored`` (torch's ignore list)."""

    def __init__(self, module: nn.Module, ignored: set[str]) -> None:
        self._slots: list[tuple[nn.Module, str]] = []
        seen: set[int] = set()
        for prefix, submodule in module.named_modules():
            for name, buffer in submodule.named_buffers(recurse=False):
                if id(buffer) not in seen:
                    seen.add(id(buffer))
                    if (f"{prefix}.{name}" if prefix else name) not in ignored:
                        self._slots.append((submodule, name))

    def exist(self) -> bool:
        """Whether there is any buffer to broadcast (torch's DDP broadcasts nothing, so waits for nobody,
        for a module without buffers)."""
        return any(getattr(m, name) is not None for m, name in self._slots)

    def tensors(self) -> list[torch.Tensor]:
        return [b for b in (getattr(m, name) for m, name in self._slots) if b is not None]

    def broadcast(self, process_group: dist.ProcessGroup, src: int) -> None:
        """Collective: every rank takes group rank ``src``'s buffers (before a synchronised forward)."""
        buffers = self.tensors()
        if not buffers:
            return
        with label("lightning_ddpx::broadcast_buffers"):
            with waiting_for(f"rank {src}'s buffers before forward (broadcast_buffers=True)", process_group):
                broadcast_from(buffers, process_group, src)
