"""Checkpoint writes that a killed process cannot tear: ``AtomicCheckpointIO``.

Lightning's ``TorchCheckpointIO`` serialises the checkpoint in memory, writes it to a temporary file made by
``tempfile.mkstemp()`` -- in ``$TMPDIR``, not next to the checkpoint -- and moves it over the target with
``shutil.move``. That is a rename, atomic, only when ``$TMPDIR`` and the checkpoint directory are on the
same filesystem. When they are not (``/tmp`` on tmpfs or a local disk, checkpoints on another disk or a
network share), ``shutil.move`` copies the bytes *into the target* instead: a process killed during the
copy leaves a truncated checkpoint that no longer loads, and the previous one is already gone. In both
cases nothing is fsynced, and a kill leaves a full-size orphan in ``$TMPDIR``.
``tests/lightning/test_checkpoint_safety.py`` demonstrates the torn file with a SIGKILL in the middle of the copy.

``AtomicCheckpointIO`` writes local checkpoints into a temporary file *in the target's directory*, flushes
and fsyncs it, ``os.replace``\\ s it over the target and fsyncs the directory. A reader (or a resumed job)
sees the old file or the new one, never a torn one, also after a power loss once the save has returned.
The temporary name, ``.ddpx-partial-<random>.tmp``, is hidden and matches none of the names Lightning
looks for (``*.ckpt``, ``last*.ckpt``, ``hpc_ckpt_*``), so a temporary file left by a killed process is
never mistaken for a checkpoint. Remote paths (any fsspec URL other than a local file) keep Lightning's
behaviour: object stores replace whole objects on upload, and fsspec's transaction covers the rest.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_ddpx.engine.atomic_file import TEMP_PREFIX, TEMP_SUFFIX, atomic_torch_save
from lightning_ddpx.lightning._compat import PATH, is_local_path

__all__ = ["AtomicCheckpointIO", "TEMP_PREFIX", "TEMP_SUFFIX", "atomic_torch_save"]


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


def _local_path(path: PATH) -> str:
    """``file:///x/y.ckpt`` -> ``/x/y.ckpt``; plain paths unchanged."""
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else text
