"""Communication-hook state in Lightning checkpoints: every rank's part, in one file that loads safely.

A stateful hook (PowerSGD) offers ``state_dict() -> {"shared": {...}, "per_rank": {...}}``: "shared" is
equal on every rank (iteration, warm-start memory, RNG) and is stored once; "per_rank" differs per rank
(error feedback) and is gathered to rank 0, which is the rank that writes the checkpoint. Everything is
tensors and plain values, so ``torch.load(weights_only=True)`` -- what ``Trainer.fit(ckpt_path=...)``
uses -- reads it without unpickling any code.

The entry, under ``checkpoint["lightning_ddpx"]``::

    {"format": 1, "hook": "powersgd", "world_size": 2,
     "shared": {...} | None, "per_rank": [{...rank 0...}, {...rank 1...}] | None}

``shared``/``per_rank`` are ``None`` for stateless hooks: the entry still records which hook wrote it, so a
resume with a different hook can say so. Choosing what a rank restores (:func:`select_for_rank`) is a pure
function; only :func:`gather_entry` talks to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import waiting_for

__all__ = [
    "CHECKPOINT_KEY",
    "FORMAT_VERSION",
    "Restore",
    "apply_restore",
    "check_plain",
    "gather_entry",
    "is_stateful",
    "select_for_rank",
]

CHECKPOINT_KEY = "lightning_ddpx"
FORMAT_VERSION = 1

_PLAIN_SCALARS = (bool, int, float, str, bytes, type(None))


def is_stateful(state: Any) -> bool:
    """Whether a hook state takes part in checkpoints (it has ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(state, "state_dict", None)) and callable(getattr(state, "load_state_dict", None))


def check_plain(value: Any, where: str) -> None:
    """Raise ``TypeError`` naming the first value that ``torch.load(weights_only=True)`` could not read back.

    Allowed: tensors, bool/int/float/str/bytes/None, and lists, tuples and dicts (str or int keys) of them.
    """
    if isinstance(value, (torch.Tensor, *_PLAIN_SCALARS)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__} ({key!r}); {_PLAIN_HINT}")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}; {_PLAIN_HINT}")


_PLAIN_HINT = (
    "hook state saved in checkpoints must be tensors and plain values (bool, int, float, str, None, and "
    "lists/tuples/dicts of them) so that torch.load(weights_only=True) can read it. Convert it in the "
    "state's state_dict() (e.g. a torch.Generator via .get_state(), a dataclass via dataclasses.asdict)."
)


def _split_state_dict(state: Any, hook: str) -> tuple[dict, dict]:
    sd = state.state_dict()
    if not isinstance(sd, Mapping) or set(sd) != {"shared", "per_rank"}:
        keys = sorted(sd) if isinstance(sd, Mapping) else type(sd).__name__
        raise TypeError(
            f"lightning_ddpx: the state of comm hook {hook!r} ({type(state).__qualname__}) returned {keys} from "
            "state_dict(), but checkpoints need {'shared': {...}, 'per_rank': {...}}: 'shared' equal on every "
            "rank, 'per_rank' this rank's own part (see docs/checkpointing.md)."
        )
    shared, per_rank = dict(sd["shared"]), dict(sd["per_rank"])
    where = f"the state of comm hook {hook!r}: {type(state).__qualname__}.state_dict()"
    check_plain(shared, f"{where}['shared']")
    check_plain(per_rank, f"{where}['per_rank']")
    return _to_device(shared, torch.device("cpu")), _to_device(per_rank, torch.device("cpu"))


def _split_on_every_rank(
    state: Any, hook: str, rank: int, group: dist.ProcessGroup | None
) -> tuple[dict, dict]:
    """:func:`_split_state_dict`, raising the same ``TypeError`` on every rank if it fails on any.

    A rank that raised alone (a value that only it holds is not plain) would leave the others waiting in
    the gather until the process-group timeout; one small ``all_gather_object`` lets all of them stop.
    """
    try:
        parts, problem = _split_state_dict(state, hook), None
    except TypeError as error:
        parts, problem = None, f"lightning_ddpx (rank {rank}): {str(error).removeprefix('lightning_ddpx: ')}"
    problems: list[Any] = [None] * dist.get_world_size(group)
    with waiting_for(
        f"every rank to check its state of comm hook {hook!r} before writing a checkpoint", group
    ):
        dist.all_gather_object(problems, problem, group=group)
    first = next((found for found in problems if found is not None), None)
    if first is not None:
        raise TypeError(first)
    assert parts is not None
    return parts


def gather_entry(state: Any, hook: str, group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
    """The checkpoint entry on rank 0 of ``group`` (``None`` on the others). Every rank must call it.

    Stateless hooks need no communication. For stateful ones each rank's "per_rank" part travels to rank 0
    in one ``gather_object``; tensors are moved to the CPU first so the file does not name devices.
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    entry: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "hook": hook,
        "world_size": world_size,
        "shared": None,
        "per_rank": None,
    }
    if not is_stateful(state):
        return entry if rank == 0 else None
    shared, per_rank = _split_on_every_rank(state, hook, rank, group)
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    with waiting_for(
        f"every rank's state of comm hook {hook!r}, gathered to rank 0 to write a checkpoint", group
    ):
        dist.gather_object(
            per_rank, gathered, dst=dist.get_global_rank(group or dist.group.WORLD, 0), group=group
        )
    if rank != 0:
        return None
    entry["shared"], entry["per_rank"] = shared, gathered
    return entry


@dataclass(frozen=True)
class Restore:
    """What one rank restores into its hook state, and the warning to show when that is not everything."""

    state_dict: dict[str, Any] | None  # {"shared", "per_rank"} to pass to load_state_dict, or None
    warning: str | None


def select_for_rank(entry: Any, hook: str, stateful: bool, rank: int, world_size: int) -> Restore:
    """Decide what ``rank`` restores from a checkpoint's entry (``None`` if the checkpoint has none).

    - same hook, same world size: the shared part and this rank's own part;
    - same hook, other world size: the shared part only; per-rank state (error feedback) starts from zero,
      because the data shards, and therefore every rank's residuals, are different now;
    - other hook, no entry, or an unknown format: nothing, with a warning. Never an error: the model and
      optimizer still resume, and a hook state that starts fresh costs a few steps of convergence at most.
    """
    if entry is None:
        if not stateful:
            return Restore(None, None)
        return Restore(
            None,
            f"lightning_ddpx: the checkpoint holds no communication-hook state (it was written by another strategy "
            f"or without a stateful hook), so the state of comm hook {hook!r} starts fresh: error feedback from "
            "zero, warm-start memory re-drawn, iteration count from 0. Model and optimizer are restored as usual.",
        )
    if not isinstance(entry, Mapping) or entry.get("format") != FORMAT_VERSION:
        found = entry.get("format") if isinstance(entry, Mapping) else type(entry).__name__
        return Restore(
            None,
            f"lightning_ddpx: the checkpoint's communication-hook entry has format {found!r}, but this version reads "
            f"format {FORMAT_VERSION}; the state of comm hook {hook!r} starts fresh.",
        )
    saved_hook = entry.get("hook")
    if saved_hook != hook:
        return Restore(
            None,
            f"lightning_ddpx: the checkpoint was written with comm hook {saved_hook!r}, but this run uses {hook!r}; "
            "its hook state does not apply and starts fresh. Model and optimizer are restored as usual.",
        )
    if not stateful or entry.get("shared") is None:
        return Restore(None, None)
    saved_world_size = entry.get("world_size")
    per_rank = entry.get("per_rank")
    if saved_world_size != world_size or not isinstance(per_rank, list) or len(per_rank) != world_size:
        return Restore(
            {"shared": entry["shared"], "per_rank": {}},
            f"lightning_ddpx: the checkpoint was written by {saved_world_size} processes and this run has "
            f"{world_size}. The shared state of comm hook {hook!r} (iteration, warm-start memory) is restored; "
            "per-rank state (error feedback) starts from zero because every rank's data shard has changed.",
        )
    return Restore({"shared": entry["shared"], "per_rank": per_rank[rank]}, None)


def apply_restore(state: Any, restore: Restore) -> None:
    """Load ``restore.state_dict`` into ``state``.

    Tensors arrive on the CPU (Lightning maps checkpoints there); the state's ``load_state_dict`` places them
    on its own device, since only it knows which belong there (a CPU generator's RNG state must stay put).
    A state that rejects what it is given (corrupt or edited hook state) fails here, before training
    continues, with a ``ValueError`` that names the checkpoint entry and how to resume without it.
    """
    if restore.state_dict is None:
        return
    try:
        state.load_state_dict(restore.state_dict)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(
            f"lightning_ddpx: the communication-hook state in checkpoint[{CHECKPOINT_KEY!r}] (its 'shared' part "
            f"and this rank's 'per_rank' entry) cannot be restored into {type(state).__qualname__}: "
            f"{type(error).__name__}: {error} To resume anyway, delete checkpoint[{CHECKPOINT_KEY!r}] from the "
            "file (the hook state then starts fresh, as with a checkpoint of another hook), or resume from "
            "another checkpoint."
        ) from error


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    if isinstance(value, tuple):
        return tuple(_to_device(item, device) for item in value)
    return value
