"""Import each named module first, in a process of its own, and report whether our strategy names registered.

    python tests/jobs/import_first_job.py MODULE [MODULE ...]

Prints one JSON object: module -> ``"True"`` (imported without a warning, ``"ddpx"`` in Lightning's registry),
``"False"``, or the error. Torch and torchmetrics, which every module imports before Lightning, are imported
once here; then each module gets a forked child in which neither Lightning nor ``lightning_ddpx`` is imported
yet -- what a fresh interpreter importing that module first sees, at a third of the cost (two children at a
time: the machine's two cores).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch  # noqa: F401
import torchmetrics  # noqa: F401

PARALLEL = 2


def imported_first(module: str) -> str:
    """In a fresh child: import ``module`` with warnings as errors, then ask Lightning's registry."""
    try:
        warnings.simplefilter("error")
        __import__(module)
        from lightning.pytorch.strategies import StrategyRegistry

        return str("ddpx" in StrategyRegistry)
    except BaseException:  # noqa: BLE001 - reported to the parent, whatever it was
        return traceback.format_exc()


def start(module: str) -> tuple[int, int]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, imported_first(module).encode())
        os._exit(0)
    os.close(write)
    return pid, read


def main(modules: list[str]) -> None:
    assert not any(name == "lightning" or name.startswith("lightning_ddpx") for name in sys.modules)
    pending, running, results = list(modules), {}, {}
    while pending or running:
        while pending and len(running) < PARALLEL:
            module = pending.pop(0)
            pid, read = start(module)
            running[pid] = (module, read)
        pid, status = os.wait()
        module, read = running.pop(pid)
        with os.fdopen(read, "rb") as answer:
            results[module] = answer.read().decode() or f"the child ended with status {status}"
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
