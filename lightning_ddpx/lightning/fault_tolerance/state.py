"""The whole training state of a fault-tolerant Trainer run, as one digest per piece: what a heal proves equal.

The replica check (``verify_replicas``) compares parameters and buffers. What decides later updates is more:
the optimizers' state and hyper-parameters (a learning rate a ``ReduceLROnPlateau`` lowered), the
schedulers, the loops' progress, every callback's state (ModelCheckpoint's best and top-k, EarlyStopping's
wait and best). :func:`state_digests` takes the dict ``trainer.save_checkpoint`` would write and gives a
digest for each of those pieces, so that the members can compare them after a newcomer was healed and
name the piece that differs.

With a hook that averages parameters (DiLoCo, post-local SGD) each replica trains on its own between
averages, its parameters and optimizer state included: the caller leaves those two pieces out there.

Left out, because they are per process by design or not carried by Lightning's own resume (and decide
nothing later):

- the module's buffers: a forward updates them from its own batch (BatchNorm's running statistics), as
  under torch's DDP, until the next forward broadcasts one rank's; the heal broadcasts and checks them;
- the progress of the evaluation loops that are not running (``val_loop`` inside the fit loop, and the
  validate/test/predict loops): each run starts them from zero, and a resume resets them;
- ModelCheckpoint's ``current_score`` (its subclasses' too): the last monitored value, recomputed at every
  save.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import torch

__all__ = ["digest", "state_digests"]

_EVALUATION_LOOPS = ("validate_loop", "test_loop", "predict_loop")
# ModelCheckpoint's (and its subclasses'): its state has a best_model_score beside it
_PER_SAVE_FIELD, _CHECKPOINT_MARK = "current_score", "best_model_score"


def state_digests(checkpoint: dict[str, Any], parameter_names: Iterable[str]) -> dict[str, str]:
    """A digest (12 hex digits) per piece of ``checkpoint`` (a Lightning checkpoint dict): ``parameters``
    (the entries of ``state_dict`` named in ``parameter_names``), ``optimizer state`` (moments, step
    counts), ``optimizer hyper-parameters`` (each param group's learning rate, betas...), ``schedulers``,
    ``loops``, ``progress`` (epoch and global step), and one per callback, under its state key."""
    names = set(parameter_names)
    loops = {
        name: state for name, state in checkpoint.get("loops", {}).items() if name not in _EVALUATION_LOOPS
    }
    fit_loop = loops.get("fit_loop")
    if isinstance(fit_loop, dict):
        loops["fit_loop"] = {
            key: value for key, value in fit_loop.items() if not key.startswith("epoch_loop.val_loop")
        }
    optimizers = checkpoint.get("optimizer_states") or []
    pieces: dict[str, Any] = {
        "parameters": {key: value for key, value in checkpoint.get("state_dict", {}).items() if key in names},
        "optimizer state": [state.get("state") if isinstance(state, dict) else state for state in optimizers],
        "optimizer hyper-parameters": [
            state.get("param_groups") if isinstance(state, dict) else None for state in optimizers
        ],
        "schedulers": checkpoint.get("lr_schedulers"),
        "loops": loops,
        "progress": (checkpoint.get("epoch"), checkpoint.get("global_step")),
    }
    for key, state in checkpoint.get("callbacks", {}).items():
        if isinstance(state, dict) and _CHECKPOINT_MARK in state:
            state = {field: value for field, value in state.items() if field != _PER_SAVE_FIELD}
        pieces[key] = state
    return {name: digest(value) for name, value in pieces.items()}


def digest(value: Any) -> str:
    """12 hex digits of a sha256 over ``value`` (nested dicts, lists, tensors, plain values)."""
    hashed = hashlib.sha256()
    _feed(hashed, value)
    return hashed.hexdigest()[:12]


def _feed(digest: Any, value: Any) -> None:
    """Tensors by dtype, shape and bytes; mappings in key order; sequences in order; the rest by ``repr``."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(f"<{key!s}>".encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}]".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(repr(value).encode())
