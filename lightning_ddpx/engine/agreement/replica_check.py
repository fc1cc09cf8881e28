"""Replica verification: are the model replicas on every rank still bitwise equal?

Data parallelism is correct only while every rank holds the same weights; a gradient that was never
averaged (a parameter unfrozen on one rank, a backward outside the wrapper, a custom hook that reduces
nothing) lets them drift apart without any error. :func:`verify_replicas` makes that visible cheaply:

- each rank reduces every tensor to a digest of its raw bytes: the bytes viewed as 64-bit words, summed
  twice with wrap-around: the words, and their running sums (word ``i`` of ``n`` weighted by ``n - i``, so
  moved values count too). A change of one word always changes the first sum; several changes go unnoticed
  only if both sums collide. No floating-point arithmetic is involved, so equal bytes give equal digests
  and ``-0.0`` differs from ``0.0`` (bitwise, as asked). A running sum costs about a tenth of squaring the
  words (no multiply, and the temporary is written in one sequential pass): docs/benchmarks.md;
- the per-tensor digests fold into one, weighted by the tensor's position, and one ``all_gather`` of a few
  int64s (the step, the tensor count, the folded digest) compares the ranks;
- only on a mismatch, a second ``all_gather`` of the per-tensor digests finds the first tensor that
  differs and the ranks whose copy differs from the lowest rank's.

Every rank gathers the same data and so reaches the same decision: all return, or all raise
:class:`ReplicaMismatchError`. It is a collective: every rank of the group must call it at the same point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["ReplicaMismatchError", "ReplicaReport", "named_state", "tensor_digest", "verify_replicas"]

_WORDS_PER_DIGEST = 2


class ReplicaMismatchError(RuntimeError):
    """The ranks' replicas differ (or the ranks are at different steps); raised on every rank alike."""


@dataclass(frozen=True)
class ReplicaReport:
    """What a successful verification compared (the same on every rank)."""

    step: int
    tensors: int
    bytes_per_rank: int


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 words that depend on every byte of ``tensor`` and its order (wrap-around sums of the 64-bit
    words and of their running sums; see the module docstring)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(_WORDS_PER_DIGEST, dtype=torch.int64, device=flat.device)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    raw = flat.contiguous().view(torch.uint8)
    if raw.numel() % 8:
        raw = torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)])
    words = raw.view(torch.int64)
    return torch.stack([words.sum(), words.cumsum(0).sum()])


def named_state(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    named_buffers: Iterable[tuple[str, torch.Tensor]] = (),
    optimizer: torch.optim.Optimizer | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The tensors to compare, named for the error: parameters, then buffers, then each parameter's optimizer
    state (by key, sorted; plain numbers such as a step count become tensors)."""
    parameters = list(named_parameters)
    named = [(f"parameter {name!r}", p) for name, p in parameters]
    named += [(f"buffer {name!r}", b) for name, b in named_buffers if b is not None]
    if optimizer is not None:
        name_of = {id(p): repr(name) for name, p in parameters}
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                state = optimizer.state.get(p)
                if not state:
                    continue
                who = name_of.get(id(p), f"param_groups[{g}]['params'][{i}]")
                for key in sorted(state, key=str):
                    value = state[key]
                    if not isinstance(value, torch.Tensor):
                        if not isinstance(value, (int, float, bool)):
                            continue
                        value = torch.tensor(value, dtype=torch.float64)
                    named.append((f"optimizer state {key!r} of {who}", value))
    return named


def _fold(digests: torch.Tensor) -> torch.Tensor:
    """One digest for all tensors, weighted by position (odd weights: a digest moved to another tensor counts)."""
    if digests.numel() == 0:
        return torch.zeros(_WORDS_PER_DIGEST, dtype=torch.int64, device=digests.device)
    weights = torch.arange(1, 2 * len(digests), 2, dtype=torch.int64, device=digests.device).unsqueeze(1)
    return (digests * weights).sum(0)


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """All ranks' ``tensor`` (same shape everywhere) stacked, on the CPU."""
    sent = tensor.to(device)
    parts = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, sent, group=group)
    return torch.stack([part.cpu() for part in parts])


def verify_replicas(
    named: Sequence[tuple[str, torch.Tensor]],
    process_group: dist.ProcessGroup,
    step: int,
    device: torch.device | None = None,
    what: str = "",
    among: Sequence[int] | None = None,
) -> ReplicaReport:
    """Collective: raise :class:`ReplicaMismatchError` on every rank unless every rank's ``named`` tensors are
    bitwise equal and every rank passed the same ``step``. ``device``: where the group's collectives run
    (CUDA for NCCL); ``what`` names the caller for the error (e.g. "before saving a checkpoint").
    ``among``: compare only these ranks of the group with the first of them (a replica copied from another,
    where the others differ by design); every rank still takes part and reaches the same decision."""
    device = device or torch.device("cpu")
    # each digest computed where its tensor lives (no copy of the tensors), then gathered on ``device``
    digests = (
        torch.stack([tensor_digest(t).to(device) for _, t in named])
        if named
        else torch.zeros(0, _WORDS_PER_DIGEST, dtype=torch.int64, device=device)
    )
    head = torch.tensor([step, len(named)], dtype=torch.int64, device=device)
    summary = torch.cat([head, _fold(digests)])
    rows = list(range(dist.get_world_size(process_group))) if among is None else list(dict.fromkeys(among))
    gathered = _gather(summary, process_group, device)[rows]
    group_ranks = dist.get_process_group_ranks(process_group)
    rank_of = [group_ranks[r] for r in rows]
    when = f" ({what})" if what else ""
    if not bool((gathered[:, :2] == gathered[0, :2]).all()):
        steps = {rank_of[r]: int(gathered[r, 0]) for r in range(len(rank_of))}
        counts = {rank_of[r]: int(gathered[r, 1]) for r in range(len(rank_of))}
        raise ReplicaMismatchError(
            f"lightning_ddpx: replica verification{when}: the ranks disagree on what to compare: steps by rank "
            f"{steps}, tensors by rank {counts}. The ranks are out of step (one ran more optimizer steps, or "
            "their models differ in structure); training cannot continue consistently. Restart from the last "
            "verified checkpoint and make every rank run the same steps."
        )
    if bool((gathered == gathered[0]).all()):
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return ReplicaReport(step=step, tensors=len(named), bytes_per_rank=nbytes)
    _raise_first_difference(named, digests, process_group, device, step, when, rows, rank_of)
    raise AssertionError("unreachable")  # pragma: no cover


def _raise_first_difference(
    named: Sequence[tuple[str, torch.Tensor]],
    digests: torch.Tensor,
    process_group: dist.ProcessGroup,
    device: torch.device,
    step: int,
    when: str,
    rows: list[int],
    rank_of: list[int],
) -> None:
    """The second collective (on a mismatch only): every rank's per-tensor digests (those of ``rows``
    compared); raise naming the first that differs."""
    table = _gather(digests, process_group, device)[rows]  # [compared ranks, tensors, words]
    differs = (table != table[0]).any(dim=2).any(dim=0)
    first = int(differs.nonzero()[0, 0])
    odd = [rank_of[r] for r in range(len(rank_of)) if not bool((table[r, first] == table[0, first]).all())]
    count = int(differs.sum())
    label, tensor = named[first]
    raise ReplicaMismatchError(
        f"lightning_ddpx: replica verification{when} at step {step}: {label} (shape {tuple(tensor.shape)}, "
        f"{tensor.dtype}) differs between ranks: ranks {odd} hold a different value from rank {rank_of[0]} "
        f"({count} of {len(named)} tensors differ). The replicas have diverged: some gradient was not averaged "
        "(a parameter trained outside the wrapper, a backward through .module, a custom hook that does not "
        "reduce, different random state per rank in the model). Do not trust checkpoints written after the "
        "last successful verification; see docs/troubleshooting.md (replicas differ)."
    )
