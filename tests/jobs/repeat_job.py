"""Run one rank of a job module many times, each run a process of its own that exits as a script's does.

    python tests/jobs/repeat_job.py OUT_DIR MODULE RUNS_JSON

``RUNS_JSON``: a list, one entry per run, of ``{"port": PORT, "args": [ARG, ...]}``. For each run, a child
forked from this process runs ``python -m MODULE ARG ...`` in place: ``MASTER_PORT`` set to its port, its
stdout and stderr in ``OUT_DIR/run<i>-rank<RANK>.out``. When the
module returns (or raises), the child leaves through the interpreter's own exit -- atexit handlers, thread
shutdown, module teardown: where the abort the repeats hunt for happened -- not through ``os._exit``. The
parent waits for it and goes on to the next run; at the end it prints one JSON list, per run its return code
(negative: the signal that ended it, as ``subprocess`` reports it) and its output file.

Why: a run of ``tests.jobs.exit_job`` is about 5 s, most of it importing torch and Lightning, and torch's
compiler stack at the first optimizer's construction (1.4 s). Both happen once here, before any child, so
every run pays only for its own work; each still starts its own
process group, gloo threads and store, and ends the way a user's script ends. Run one of these per rank, as
the ranks of one job (``RANK``/``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set): the children of
run ``i`` meet on its port.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import sys

import torch


def run_in_child(module: str, args: list[str], port: str, output: str) -> None:
    """In the forked child: output to ``output``, then the module as ``__main__``; never returns."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ["MASTER_PORT"] = port
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # unwinds to the interpreter's exit, as the end of a script does


def main() -> None:
    out_dir, module, runs_json = sys.argv[1:]
    importlib.import_module(module)  # torch, Lightning, ours: imported once, before any child
    del sys.modules[module]  # the module itself runs afresh in each child, as ``python -m`` runs it
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # what torch imports at a first optimizer
    # Objects from before the fork stay out of the children's collections: a collection writing to each of
    # them would copy every shared page (4-5 s per child at its exit, measured; a fresh process: none)
    gc.freeze()
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    runs = []
    for index, run in enumerate(json.loads(runs_json)):
        output = os.path.join(out_dir, f"run{index}-rank{rank}.out")
        pid = os.fork()
        if pid == 0:
            run_in_child(module, [str(arg) for arg in run["args"]], str(run["port"]), output)
        _, status = os.waitpid(pid, 0)
        runs.append({"returncode": os.waitstatus_to_exitcode(status), "output": output})
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
