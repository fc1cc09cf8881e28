"""One benchmark rank: ``python -m benchmarks.rank_worker CONFIG RANK``, started by ``benchmarks.common.launch``
through the shipped launcher (``lightning_ddpx.bench.launch.run_ranks``), so every benchmark starts its ranks
the same way, over loopback or an emulated link.

The config names the function (``module:qualname``) and carries its arguments pickled; the rank joins the
gloo group from the environment run_ranks sets, calls ``fn(rank, world_size, *args)`` and writes the
pickled result where run_ranks reads it.
"""

from __future__ import annotations

import base64
import importlib
import json
import pickle
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_ddpx.bench.launch import write_result
from lightning_ddpx.engine.exit_threads import wait_for_idle_gloo_workers


def encode(value: Any) -> str:
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))  # noqa: S301 - our own processes' output


def _function(path: str) -> Any:
    module_name, _, qualname = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def main(config_path: str, rank: int) -> None:
    with open(config_path) as f:
        config = json.load(f)
    # One intra-op thread per process: two processes on a small CPU machine must not oversubscribe cores,
    # or the measurement becomes a measurement of the OS scheduler.
    torch.set_num_threads(1)
    world_size = config["world_size"]
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=config["pg_timeout_s"])
    )
    try:
        function = _function(config["function"])
        if config.get("main_module"):  # the arguments were pickled in a script run as __main__
            sys.modules["__main__"] = importlib.import_module(config["main_module"])
        result = function(rank, world_size, *decode(config["args"]))
        write_result(config_path, rank, {"pickle": encode(result)})
    finally:
        dist.destroy_process_group()
        # a contender's model may still reference the group, keeping gloo's workers alive past the destroy
        wait_for_idle_gloo_workers()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
