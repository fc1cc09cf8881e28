"""Checkpoint writes that a killed process cannot tear: ``AtomicCheckpointIO``.

Lightning's ``TorchCheckpointIO`` serialises the checkpoint in memory, writes it to a temporary file made by
``tempfile.mkstemp()`` -- in ``$TMPDIR``, not next to the checkpoint -- and moves it over the target with
``shutil.move``. That is a rename, atomic, only when ``$TMPDIR`` and the checkpoint directory are on the
same filesystem. When they are not (``/tmp`` on tmpfs or a local disk, checkpoints on another disk or a
network share), ``shutil.move`` copies the bytes *into the target* instead: a process killed during the
copy leaves a truncated checkpoint that no longer loads, and the previous one is already gone. In both
cases nothing is fsynced, and a kill leaves a full-size orphan in ``$TMPDIR``.
``tests/test_checkpoint_safety.py`` demonstrates the torn file with a SIGKILL in the middle of the copy.

``AtomicCheckpointIO`` writes local checkpoints into a temporary file *in the target's directory*, flushes
and fsyncs it, ``os.replace``\\ s it over the target and fsyncs the directory. A reader (or a resumed job)
sees the old file or the new one, never a torn one, also after a power loss once the save has returned.
The temporary name, ``.ddpx-partial-<random>.tmp``, is hidden and matches none of the names Lightning
looks for (``*.ckpt``, ``last*.ckpt``, ``hpc_ckpt_*``), so a temporary file left by a killed process is
never mistaken for a checkpoint. Remote paths (any fsspec URL other than a local file) keep Lightning's
behaviour: object stores replace whole objects on upload, and fsspec's transaction covers the rest.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any, BinaryIO, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_ddpx.lightning._compat import PATH, is_local_path

__all__ = ["AtomicCheckpointIO", "TEMP_PREFIX", "TEMP_SUFFIX", "atomic_torch_save"]

log = logging.getLogger(__name__)

TEMP_PREFIX = (
    ".ddpx-partial-"  # hidden; contains none of Lightning's name keys ("last", "hpc_ckpt_", ".ckpt")
)
TEMP_SUFFIX = ".tmp"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic and durable (see the module docstring).

    Both ``DDPXStrategy`` classes (Trainer and Fabric) use it by default; with any other strategy pass
    ``Trainer(plugins=[AtomicCheckpointIO()])``. Loading and removing are Lightning's.

    Example::

        >>> import lightning as L
        >>> from lightning_ddpx import AtomicCheckpointIO
        >>> trainer = L.Trainer(strategy="ddp", plugins=[AtomicCheckpointIO()])  # doctest: +SKIP
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PATH, storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None or not is_local_path(path):
            # Remote URLs: Lightning's fsspec transaction. storage_options: Lightning's error for it.
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        atomic_torch_save(checkpoint, _local_path(path))


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


def _local_path(path: PATH) -> str:
    """``file:///x/y.ckpt`` -> ``/x/y.ckpt``; plain paths unchanged."""
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else text


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
