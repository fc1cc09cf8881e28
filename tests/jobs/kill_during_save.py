"""A process that dies while writing a checkpoint, for tests/lightning/test_checkpoint_safety.py.

    python -m tests.jobs.kill_during_save MODE TARGET

Writes ``{"version": 1, "weights": <16 MiB of 1.0>}`` to TARGET and is SIGKILLed on the way, at a point
chosen by MODE -- deterministically, by replacing one step of the write with "do part of it, then
SIGKILL myself":

- ``mid-write``: ``AtomicCheckpointIO``; half of the serialised bytes are written, then the kill.
- ``before-replace``: ``AtomicCheckpointIO``; all bytes are written and fsynced, the kill comes instead of
  the rename.
- ``lightning-copy``: Lightning's ``TorchCheckpointIO``; the kill comes after the first MiB of the copy
  that ``shutil.move`` makes when ``$TMPDIR`` is on another filesystem than TARGET.
- ``loop``: ``AtomicCheckpointIO`` writing versions 1, 2, 3, ... forever; the test kills it from outside.
"""

from __future__ import annotations

import io
import os
import signal
import sys

import torch

NUMEL = 4 << 20  # 16 MiB of float32: large enough that a write is not one syscall


def checkpoint(version: int) -> dict:
    return {"version": version, "weights": torch.full((NUMEL,), float(version))}


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(mode: str, target: str) -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_ddpx.engine import atomic_file
    from lightning_ddpx.lightning.checkpoints.checkpoint_io import AtomicCheckpointIO

    if mode == "mid-write":

        def write_half(obj, file):
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            file.write(buffer.getvalue()[: buffer.tell() // 2])
            file.flush()
            die()

        atomic_file._write = write_half
        AtomicCheckpointIO().save_checkpoint(checkpoint(1), target)
    elif mode == "before-replace":
        os.replace = lambda *args: die()
        AtomicCheckpointIO().save_checkpoint(checkpoint(1), target)
    elif mode == "lightning-copy":
        sendfile = os.sendfile

        def send_one_mib_then_die(out_fd, in_fd, offset, count):
            sendfile(out_fd, in_fd, offset, min(count, 1 << 20))
            die()

        os.sendfile = send_one_mib_then_die  # shutil's copy on Linux; a rename never calls it
        TorchCheckpointIO().save_checkpoint(checkpoint(1), target)
    elif mode == "loop":
        io_plugin = AtomicCheckpointIO()
        version = 1
        while True:
            io_plugin.save_checkpoint(checkpoint(version), target)
            print(version, flush=True)
            version += 1
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    raise SystemExit(f"mode {mode!r}: the save returned, but the process should have been killed")


if __name__ == "__main__":
    main(*sys.argv[1:])
