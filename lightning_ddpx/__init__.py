"""lightning-ddpx: a data-parallel module on our own bucketed gradient reducer, and its Lightning strategy.

The engine's names (``DistributedDataParallel``, ``GradBucket``, ...) import torch only. The Lightning
names (``DDPXStrategy``, ``AtomicCheckpointIO``, the ``fabric`` module) are loaded on first use, and the
strategy names (``strategy="ddpx"``, ...) are registered with Lightning as soon as Lightning is imported,
before or after this package. Layers: ``engine/`` <- ``hooks/`` <- ``lightning/``; tooling in ``bench/``;
see docs/dev/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_ddpx import _import_hooks
from lightning_ddpx.engine.bucketing import BucketInfo
from lightning_ddpx.engine.comm_stats import CommStatsSummary, StepCommStats
from lightning_ddpx.engine.compile import GraphSplit, compile_model, compiled_graphs
from lightning_ddpx.engine.diagnosis import CollectiveMismatchError
from lightning_ddpx.engine.grad_bucket import GradBucket, collectives_issued_on_call, record_bytes_sent
from lightning_ddpx.engine.module import DistributedDataParallel
from lightning_ddpx.engine.replica_check import ReplicaMismatchError, ReplicaReport

if TYPE_CHECKING:
    from lightning_ddpx.lightning.checkpoint_io import AtomicCheckpointIO
    from lightning_ddpx.lightning.strategy import DDPXStrategy
    from lightning_ddpx.lightning.uneven import UnevenInputsError

__all__ = [
    "AtomicCheckpointIO",
    "BucketInfo",
    "CollectiveMismatchError",
    "CommStatsSummary",
    "DDPXStrategy",
    "DistributedDataParallel",
    "GradBucket",
    "GraphSplit",
    "ReplicaMismatchError",
    "ReplicaReport",
    "StepCommStats",
    "UnevenInputsError",
    "collectives_issued_on_call",
    "compile_model",
    "compiled_graphs",
    "record_bytes_sent",
]
__version__ = "0.1.0"

# Public names whose modules import Lightning: loaded by __getattr__ on first use.
_LAZY_NAMES = {
    "AtomicCheckpointIO": "lightning_ddpx.lightning.checkpoint_io",
    "DDPXStrategy": "lightning_ddpx.lightning.strategy",
    "UnevenInputsError": "lightning_ddpx.lightning.uneven",
}
_SUBPACKAGES = ("bench", "engine", "fabric", "hooks", "lightning")

# Module paths from before the layers (0.1.0's flat package) -> where the module lives now.
_MOVED_MODULES = {
    **{
        f"lightning_ddpx.{name}": f"lightning_ddpx.engine.{name}"
        for name in (
            "backward_start",
            "bucketing",
            "comm_stats",
            "compile",
            "consistency",
            "cuda_streams",
            "diagnosis",
            "errors",
            "grad_bucket",
            "graph",
            "join",
            "launcher",
            "profiling",
            "reducer",
            "static_graph",
        )
    },
    **{
        f"lightning_ddpx.{name}": f"lightning_ddpx.lightning.{name}"
        for name in (
            "checkpoint_io",
            "checkpoint_state",
            "config",
            "ddp_kwargs",
            "fabric",
            "local_replicas",
            "post_local_sgd_setup",
            "process_exit",
            "strategy",
            "uneven",
        )
    },
    "lightning_ddpx.distributed": "lightning_ddpx.engine.module",
    "lightning_ddpx.model_averaging": "lightning_ddpx.hooks.model_averaging",
    "lightning_ddpx.netns": "lightning_ddpx.bench.netns",
    "lightning_ddpx.hooks.backend_support": "lightning_ddpx.engine.backend_support",
    "lightning_ddpx.hooks.lowrank": "lightning_ddpx.hooks.powersgd.lowrank",
    "lightning_ddpx.hooks.powersgd_remap": "lightning_ddpx.hooks.powersgd.remap",
    "lightning_ddpx.hooks.powersgd_state": "lightning_ddpx.hooks.powersgd.state",
    "lightning_ddpx.hooks.powersgd_state_check": "lightning_ddpx.hooks.powersgd.state_check",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | set(_SUBPACKAGES))


def _register_strategy_names() -> None:
    """Importing the two strategy modules registers "ddpx", "ddpx_powersgd", ... with the Trainer and Fabric."""
    importlib.import_module("lightning_ddpx.lightning.strategy")
    importlib.import_module("lightning_ddpx.lightning.fabric")


_import_hooks.alias_moved_modules(_MOVED_MODULES)
_import_hooks.register_when_imported("lightning.pytorch", _register_strategy_names)
