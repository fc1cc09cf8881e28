"""Side-by-side training of our DistributedDataParallel and torch's, for oracle tests.

Both wrap identical copies of one model, see identical rank-dependent batches (so an unreduced gradient
cannot pass by accident), and take the same SGD steps. After every step gradients, parameters and buffers
are compared; the first difference fails on the rank that sees it, naming step and tensor.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from lightning_ddpx.engine.transport.transports import SharedMemorySum


def rank_batch(rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A batch that differs per rank and per step, deterministic across runs."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=generator) * (rank + 1)


def assert_same_tensors(
    ours: dict[str, torch.Tensor | None],
    reference: dict[str, torch.Tensor | None],
    what: str,
    rtol: float,
    atol: float,
) -> None:
    assert ours.keys() == reference.keys(), f"{what}: names differ: {sorted(ours)} vs {sorted(reference)}"
    for name in ours:
        a, b = ours[name], reference[name]
        if a is None or b is None:
            assert a is None and b is None, (
                f"{what} {name!r}: ours is {a is None and 'None'}, torch's is {b is None and 'None'}"
            )
            continue
        prefix = f"{what} {name!r}"
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, prefix=prefix: f"{prefix}: {m}")


def train_side_by_side(
    rank: int,
    build: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module, int], torch.Tensor],
    steps: int,
    ours_kwargs: dict[str, Any] | None = None,
    torch_kwargs: dict[str, Any] | None = None,
    hooks: tuple[tuple[Any, Any], tuple[Any, Any]] | None = None,
    accumulate: int = 1,
    rtol: float = 1e-6,
    atol: float = 1e-7,
    lr: float = 0.05,
) -> dict[str, Any]:
    """Train both wrappers ``steps`` optimizer steps and compare after each; returns a summary.

    ``loss_fn(model, micro_step)`` runs forward on the wrapper and returns the loss. ``hooks`` is
    ``((our_state, our_hook), (torch_state, torch_hook))``; the states are built by the caller.
    ``accumulate`` > 1 runs ``accumulate - 1`` micro-batches inside ``no_sync()`` before each synced one.
    """
    torch.manual_seed(0)
    base = build()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **(ours_kwargs or {}))
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **(torch_kwargs or {}))
    if hooks is not None:
        ours.register_comm_hook(*hooks[0])
        theirs.register_comm_hook(*hooks[1])
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (ours, theirs)]
    plans = []
    micro = 0
    for step in range(steps):
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad()
            for k in range(accumulate):
                if k < accumulate - 1:
                    with model.no_sync():
                        loss_fn(model, micro + k).backward()
                else:
                    loss_fn(model, micro + k).backward()
        micro += accumulate
        grads = [{n: p.grad for n, p in m.module.named_parameters()} for m in (ours, theirs)]
        assert_same_tensors(grads[0], grads[1], f"rank {rank} step {step} grad", rtol, atol)
        for optimizer in optimizers:
            optimizer.step()
        params = [dict(m.module.named_parameters()) for m in (ours, theirs)]
        assert_same_tensors(params[0], params[1], f"rank {rank} step {step} param", rtol, atol)
        buffers = [dict(m.module.named_buffers()) for m in (ours, theirs)]
        assert_same_tensors(buffers[0], buffers[1], f"rank {rank} step {step} buffer", rtol, atol)
        plans.append([info.parameter_names for info in ours.bucket_plan()])
    return {
        "params": {n: p.detach().clone() for n, p in ours.module.named_parameters()},
        "plans": plans,
        "path": default_path(ours),
    }


def default_path(model: lightning_ddpx.DistributedDataParallel) -> str:
    """How ``model``'s default path reduces its buckets: ``shared_memory`` (two CPU ranks on one machine) or
    ``whole`` (one all-reduce per bucket)."""
    return "shared_memory" if isinstance(model.reducer.transport, SharedMemorySum) else "whole"


def set_shared_memory(enabled: bool) -> None:
    """In a test's worker process, before building the module: allow (the default) or refuse the
    shared-memory path (``DDPX_SHARED_MEMORY``, read when the module is built)."""
    os.environ["DDPX_SHARED_MEMORY"] = "1" if enabled else "0"


class Branches(nn.Module):
    """Rank 0 uses branch ``a``, the other ranks ``b``: the used-parameter bitmap differs per rank, and with
    ``never`` a third branch is unused on every rank (its gradient stays None). Inputs have 16 features."""

    def __init__(self, hidden: int = 16, out: int = 4, never: bool = True) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, hidden)
        self.a = nn.Linear(hidden, out)
        self.b = nn.Linear(hidden, out)
        if never:
            self.never = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.a(h) if dist.get_rank() == 0 else self.b(h)


def wide_4mib_mlp() -> nn.Module:
    """A 1024 x 1024 layer (4 MiB): a bucket as large as the default cap's, larger than any slot alignment."""
    return nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 4))
