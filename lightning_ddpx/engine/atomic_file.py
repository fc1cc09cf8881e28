"""Atomic, durable file writes: ``atomic_torch_save``, every checkpoint's writer.

The Lightning strategies' :class:`~lightning_ddpx.lightning.checkpoints.checkpoint_io.AtomicCheckpointIO` and the fault
tolerance's own ``FaultTolerance.save_checkpoint`` write through it: a temporary file in the target's
directory, flushed and fsynced, ``os.replace``\\ d over the target, the directory fsynced. A reader sees the
old file or the new one, never a torn one, also after a power loss once the write has returned. The
temporary name, ``.ddpx-partial-<random>.tmp``, is hidden and matches none of the names Lightning looks for
(``*.ckpt``, ``last*.ckpt``, ``hpc_ckpt_*``), so one left by a killed process is never taken for a checkpoint.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any, BinaryIO

import torch

__all__ = ["TEMP_PREFIX", "TEMP_SUFFIX", "atomic_torch_save"]

log = logging.getLogger(__name__)

TEMP_PREFIX = (
    ".ddpx-partial-"  # hidden; contains none of Lightning's name keys ("last", "hpc_ckpt_", ".ckpt")
)
TEMP_SUFFIX = ".tmp"


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` so that ``path`` holds either its previous content or all of ``obj``.

    Steps: write a temporary file in the same directory (so the final rename never crosses filesystems),
    flush and fsync it (its data is on disk before its name is), ``os.replace`` it over ``path`` (atomic on
    POSIX and Windows), then fsync the directory (the new name survives a power loss). If writing fails
    with an exception the temporary file is removed; if the process is killed, it stays behind under a
    name no checkpoint lookup matches.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    file, temp_path = _open_temporary(directory)
    try:
        with file:
            _write(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_path, path)
    except BaseException:
        _remove_quietly(temp_path)
        raise
    _fsync_directory(directory)
    log.debug(f"Saved checkpoint atomically: {path}")


def _write(obj: Any, file: BinaryIO) -> None:
    """Serialise straight into the file (no second copy of the checkpoint in memory)."""
    torch.save(obj, file)


def _open_temporary(directory: str) -> tuple[BinaryIO, str]:
    """A new, exclusively created file in ``directory``; permissions follow the umask like a plain open."""
    while True:
        temp_path = os.path.join(directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:  # 64 random bits taken already: draw again
            continue
        return os.fdopen(fd, "wb"), temp_path


def _fsync_directory(directory: str) -> None:
    """Persist the rename. Not possible on Windows (directories cannot be opened) nor on some network
    filesystems (EINVAL); the replace itself is still atomic there, only not yet durable."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        log.debug(f"fsync of directory {directory} not supported: {error}")
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
