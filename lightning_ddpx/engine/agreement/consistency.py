"""Make every rank start from the same model: verify the parameter layout, then copy rank 0's values.

Both steps run once at construction. The check comes first and is cheap (one small all-gather of a
digest); only when digests differ do ranks exchange full descriptions, so the error can name the first
parameter that differs and what each rank holds. The all-gather also carries one integer of the caller's
per rank (whether the rank can use shared memory), so that construction needs no collective for it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist

from lightning_ddpx._compat.torch import foreach_copy_
from lightning_ddpx.engine.agreement.errors import waiting_for

__all__ = [
    "ModelMismatchError",
    "ParameterSignature",
    "broadcast_from",
    "broadcast_from_rank0",
    "describe_setting_difference",
    "start_alike",
    "verify_same_parameters",
    "verify_same_settings",
]

ParameterSignature = tuple[str, tuple[int, ...], str, bool]  # name, shape, dtype, requires_grad


class ModelMismatchError(RuntimeError, ValueError):
    """Ranks hold different models: torch's DDP raises ``RuntimeError`` (or times out), earlier releases of
    lightning_ddpx ``ValueError``; this is both."""


def _signatures(named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> list[ParameterSignature]:
    return [(name, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for name, p in named_parameters]


def _digest(value: object) -> int:
    raw = hashlib.sha256(repr(value).encode()).digest()[:8]
    return struct.unpack("<q", raw)[0]


def verify_same_parameters(
    named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
    process_group: dist.ProcessGroup,
    device: torch.device,
    carry: int = 0,
) -> list[int]:
    """Raise ``ValueError`` on every rank if ranks hold different parameters; else return every rank's
    ``carry`` (an integer that travels on the same all-gather, saving the caller a collective).

    Compares count, names, shapes, dtypes and ``requires_grad``; the message names the first parameter
    that differs and the value on each rank.
    """
    signatures = _signatures(named_parameters)
    world_size = dist.get_world_size(process_group)
    mine = torch.tensor([_digest(signatures), carry], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=process_group)
    if all(int(d[0]) == int(gathered[0][0]) for d in gathered):
        return [int(d[1]) for d in gathered]
    everyone: list[list[ParameterSignature] | None] = [None] * world_size
    dist.all_gather_object(everyone, signatures, group=process_group)
    raise ModelMismatchError(describe_first_difference(everyone))  # type: ignore[arg-type]


def start_alike(
    named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
    buffers: Sequence[torch.Tensor] | None,
    process_group: dist.ProcessGroup,
    device: torch.device,
    carry: int,
) -> list[int]:
    """Collective, at construction: every rank holds the same parameters and broadcasts its buffers alike
    (else every rank raises, naming the first difference), then takes rank 0's parameters and ``buffers``
    (``None``: the buffers stay each rank's own, torch's ``broadcast_buffers=False``). Returns every rank's
    ``carry``, which the model check's all-gather carries with the buffer rule."""
    with waiting_for("every rank to describe its model (construction)", process_group):
        carried = verify_same_parameters(
            named_parameters, process_group, device, 2 * carry + (buffers is not None)
        )
    rules = [value % 2 for value in carried]
    if any(rule != rules[0] for rule in rules):
        raise ValueError(
            "lightning_ddpx.DistributedDataParallel: ranks were built with different buffer rules: "
            f"broadcast at construction per rank {[bool(rule) for rule in rules]} (broadcast_buffers=False "
            "leaves them out, forward_sync_buffers does not). Pass the same broadcast_buffers / "
            "forward_sync_buffers on every rank."
        )
    with waiting_for("rank 0's parameters and buffers (construction)", process_group):
        broadcast_from_rank0([p.detach() for _, p in named_parameters] + list(buffers or ()), process_group)
    return [value // 2 for value in carried]


def describe_first_difference(per_rank: list[list[ParameterSignature]]) -> str:
    """A message naming the first parameter whose description differs between ranks (pure, testable)."""
    header = "lightning_ddpx.DistributedDataParallel: ranks hold different models, so training would diverge or hang. "
    counts = [len(s) for s in per_rank]
    for position in range(max(counts)):
        entries = [s[position] if position < len(s) else None for s in per_rank]
        if all(e == entries[0] for e in entries):
            continue
        reference = next(e for e in entries if e is not None)
        name = reference[0]
        for field, label in ((0, "name"), (1, "shape"), (2, "dtype"), (3, "requires_grad")):
            values = [None if e is None else e[field] for e in entries]
            if any(v != values[0] for v in values):
                detail = ", ".join(
                    f"rank {rank}: {'missing' if e is None else repr(v)}"
                    for rank, (e, v) in enumerate(zip(entries, values))
                )
                return (
                    header
                    + f"First difference at parameter #{position} ({name!r}), {label}: {detail}. "
                    + f"Parameter counts per rank: {counts}. Build the same model on every rank "
                    + "(same constructor arguments, same requires_grad flags) before wrapping it."
                    + _torch_count_sentence(counts)
                )
    return header + f"Parameter counts per rank differ: {counts}." + _torch_count_sentence(counts)


def _torch_count_sentence(counts: list[int]) -> str:
    """torch's sentence when the parameter counts differ (code written for torch's DDP matches it)."""
    other = next((rank for rank, count in enumerate(counts) if count != counts[0]), None)
    if other is None:
        return ""
    return (
        f" (torch: DDP expects same model across all ranks, but Rank 0 has {counts[0]} params, while rank "
        f"{other} has inconsistent {counts[other]} params.)"
    )


def verify_same_settings(
    settings: dict[str, str], process_group: dist.ProcessGroup, device: torch.device, carry: int = 0
) -> list[int]:
    """Raise ``ValueError`` on every rank if ranks were configured differently (hook, its options, bucket
    caps, ...): their collectives would then not match, which ends in a hang or a crash inside the backend
    at some later step. One small all-gather of a digest; descriptions travel only when digests differ.
    Returns every rank's ``carry`` (an integer that travels on the same all-gather, as in
    :func:`verify_same_parameters`)."""
    world_size = dist.get_world_size(process_group)
    mine = torch.tensor([_digest(sorted(settings.items())), carry], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=process_group)
    if all(int(d[0]) == int(gathered[0][0]) for d in gathered):
        return [int(d[1]) for d in gathered]
    everyone: list[dict[str, str] | None] = [None] * world_size
    dist.all_gather_object(everyone, settings, group=process_group)
    raise ValueError(describe_setting_difference(everyone))  # type: ignore[arg-type]


def describe_setting_difference(per_rank: list[dict[str, str]]) -> str:
    """A message naming the first setting (in sorted order) that differs, with each rank's value (pure)."""
    keys = sorted(set().union(*per_rank))
    for key in keys:
        values = [settings.get(key, "<not set>") for settings in per_rank]
        if all(v == values[0] for v in values):
            continue
        ranks_by_value: dict[str, list[int]] = defaultdict(list)
        for rank, value in enumerate(values):
            ranks_by_value[value].append(rank)
        detail = "; ".join(
            f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {value}"
            for value, ranks in ranks_by_value.items()
        )
        others = [k for k in keys if k != key and len({s.get(k) for s in per_rank}) > 1]
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        more = f" Other settings that differ: {listed}." if others else ""
        return (
            "lightning_ddpx.DistributedDataParallel: ranks are configured differently, so their collectives "
            "would not match (a hang, or a crash inside the communication backend, at a later step). "
            f"Setting {key!r} differs: {detail}.{more} Give every rank the same options (the same "
            "DDPXStrategy arguments or config file; the same comm hook, hook options and bucket caps)."
        )
    return "lightning_ddpx.DistributedDataParallel: ranks are configured differently."


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], process_group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` on every rank with rank 0's values (:func:`broadcast_from`)."""
    broadcast_from(tensors, process_group, 0)


def _split_like(flat: torch.Tensor, like: Sequence[torch.Tensor]):
    offset = 0
    for tensor in like:
        yield flat[offset : offset + tensor.numel()].view_as(tensor)
        offset += tensor.numel()


@torch.no_grad()
def broadcast_from(tensors: Sequence[torch.Tensor], process_group: dist.ProcessGroup, src: int) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values: one collective per dtype, not per
    tensor."""
    grouped: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        if tensor.numel():
            grouped[(tensor.dtype, tensor.device)].append(tensor)
    for group in grouped.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, group=process_group, group_src=src)
        foreach_copy_([t.detach() for t in group], list(_split_like(flat, group)))
