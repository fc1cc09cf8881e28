"""Check a PowerSGD ``state_dict`` completely before any of it is adopted.

A checkpoint's hook state can be cut short, edited by hand, or written by other code. Loaded unchecked,
it fails later with a bare ``KeyError`` or a shape error inside a backward -- after the model and
optimizer were restored and the first steps ran. :func:`check_state_dict` raises ``ValueError`` naming the
first bad entry by its path (``state_dict['shared']['q'][3]``) and what is wrong with it, so a resume
fails before training continues and says which part of the checkpoint to drop.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch

from lightning_ddpx.hooks.layout import TensorSlot
from lightning_ddpx.hooks.powersgd.lowrank import square_side
from lightning_ddpx.hooks.powersgd.plan import plan_powersgd

__all__ = ["check_state_dict", "memory_numels"]

_RNG_STATE_NUMEL = 626  # MT19937: 624 keys, position, has_gauss
_STATS_COUNTERS = ("numel_before", "numel_after", "next_report")


class _Corrupt(ValueError):
    pass


def check_state_dict(
    state_dict: Any, rank: int, min_compression_rate: float, batch: bool, sizes: bool
) -> None:
    """Raise ``ValueError`` at the first entry of ``state_dict`` that is missing or of the wrong type or size.

    ``sizes``: also check that every warm-start Q and error-feedback tensor has the size its bucket's saved
    layout needs with these options (pass it when the memory will be kept, i.e. the options match).
    """
    try:
        _check(state_dict, rank, min_compression_rate, batch, sizes)
    except _Corrupt as error:
        raise ValueError(
            f"PowerSGD state_dict{error.args[0]}. The hook state was cut short, edited, or written by other "
            "code; it cannot be restored. Start from a fresh PowerSGDState, or resume from another checkpoint."
        ) from None


def _check(state_dict: Any, rank: int, min_compression_rate: float, batch: bool, sizes: bool) -> None:
    shared = _mapping(state_dict, "", ("shared",))["shared"]
    _mapping(shared, "['shared']", ("options", "iteration", "rng_state", "rng_gauss", "q", "layout", "stats"))
    per_rank = state_dict.get("per_rank") or {}
    _mapping(per_rank, "['per_rank']", ())
    _integer(shared["iteration"], "['shared']['iteration']")
    _mapping(shared["options"], "['shared']['options']", ())
    rng = shared["rng_state"]
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.int64 or rng.numel() != _RNG_STATE_NUMEL:
        raise _Corrupt(
            f"['shared']['rng_state'] is {_describe(rng)}, expected an int64 tensor of {_RNG_STATE_NUMEL} elements"
        )
    if isinstance(shared["rng_gauss"], bool) or not isinstance(shared["rng_gauss"], numbers.Real):
        raise _Corrupt(f"['shared']['rng_gauss'] is {_describe(shared['rng_gauss'])}, expected a float")
    stats = _mapping(shared["stats"], "['shared']['stats']", (*_STATS_COUNTERS, "per_bucket"))
    for key in _STATS_COUNTERS:
        _integer(stats[key], f"['shared']['stats'][{key!r}]")
    for index, counts in _mapping(stats["per_bucket"], "['shared']['stats']['per_bucket']", ()).items():
        where = f"['shared']['stats']['per_bucket'][{index!r}]"
        if not isinstance(counts, (list, tuple)) or len(counts) != 2:
            raise _Corrupt(f"{where} is {_describe(counts)}, expected [before, after]")
        for i, value in enumerate(counts):
            _integer(value, f"{where}[{i}]")
    layout = _by_bucket(shared["layout"], "['shared']['layout']", _signature)
    _by_bucket(shared.get("names", {}), "['shared']['names']", _names)
    _by_name(shared.get("q_pool", {}), "['shared']['q_pool']")
    _by_name(per_rank.get("error_pool", {}), "['per_rank']['error_pool']")
    q = _by_bucket(shared["q"], "['shared']['q']", _floating)
    error = _by_bucket(per_rank.get("error", {}), "['per_rank']['error']", _floating)
    for name, memory, pick in (("['shared']['q']", q, 0), ("['per_rank']['error']", error, 1)):
        for index, tensor in memory.items():
            where = f"{name}[{index!r}]"
            if index not in layout:
                raise _Corrupt(
                    f"{where} has no bucket layout (['shared']['layout'] has buckets {sorted(layout)})"
                )
            if sizes:
                expected = memory_numels(layout[index], rank, min_compression_rate, batch)[pick]
                if tensor.numel() != expected:
                    raise _Corrupt(
                        f"{where} has {tensor.numel()} elements, but bucket {index}'s saved layout needs "
                        f"{expected} with matrix_approximation_rank={rank}"
                    )


def memory_numels(
    signature: tuple[int, ...], rank: int, min_compression_rate: float, batch: bool
) -> tuple[int, int]:
    """Elements of (warm-start Q, error feedback) for a bucket of layout ``signature`` (see the hooks)."""
    if signature[:1] == (-1,):  # batched_powersgd_hook: the bucket as one zero-padded square
        side = square_side(signature[1])
        return side * min(side, rank), side * side
    slots, i = [], 0
    while i < len(signature):
        offset, ndim = signature[i], signature[i + 1]
        slots.append(TensorSlot(offset, tuple(signature[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    end = max((slot.offset + slot.numel for slot in slots), default=0)
    plan = plan_powersgd(end, slots, rank, min_compression_rate, batch)
    return plan.q_numel, plan.packed_numel


# ------------------------------------------------------------------------------------------ checks
def _mapping(value: Any, where: str, required: tuple[str, ...]) -> Mapping:
    if not isinstance(value, Mapping):
        raise _Corrupt(f"{where} is {_describe(value)}, expected a dict")
    missing = [key for key in required if key not in value]
    if missing:
        raise _Corrupt(f"{where} lacks the key(s) {missing} (it has {sorted(map(str, value))})")
    return value


def _integer(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _Corrupt(f"{where} is {_describe(value)}, expected a non-negative integer")


def _floating(value: Any, where: str) -> Any:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise _Corrupt(f"{where} is {_describe(value)}, expected a floating-point tensor")
    return value


def _signature(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
    ):
        raise _Corrupt(f"{where} is {_describe(value)}, expected a list of integers (a bucket layout)")
    signature = tuple(int(v) for v in value)
    if signature[:1] == (-1,):
        if len(signature) != 2 or signature[1] < 1:
            raise _Corrupt(
                f"{where} is {list(signature)}, expected [-1, bucket elements] for a square layout"
            )
        return signature
    i = 0
    while i < len(signature):
        if i + 1 >= len(signature) or signature[i] < 0 or signature[i + 1] < 0:
            raise _Corrupt(
                f"{where} is not a layout of (offset, ndim, *shape) entries: {list(signature)[:12]}"
            )
        i += 2 + signature[i + 1]
    if i != len(signature) or any(v < 0 for v in signature):
        raise _Corrupt(f"{where} is not a layout of (offset, ndim, *shape) entries: {list(signature)[:12]}")
    return signature


def _by_bucket(value: Any, where: str, check: Any) -> dict[int, Any]:
    checked = {}
    for index, item in _mapping(value, where, ()).items():
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise _Corrupt(f"{where} has the key {index!r}, expected bucket indices (integers >= 0)")
        checked[index] = check(item, f"{where}[{index!r}]")
    return checked


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _Corrupt(f"{where} is {_describe(value)}, expected a list of parameter names")
    return tuple(value)


def _by_name(value: Any, where: str) -> None:
    for name, tensor in _mapping(value, where, ()).items():
        if not isinstance(name, str):
            raise _Corrupt(f"{where} has the key {name!r}, expected parameter names")
        _floating(tensor, f"{where}[{name!r}]")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"a {type(value).__name__} ({text[:40]}{'...' if len(text) > 40 else ''})"
