"""lightning-ddpx: a data-parallel module on our own bucketed gradient reducer, and its Lightning strategy.

The engine's names (``DistributedDataParallel``, ``GradBucket``, ...) import torch only. The Lightning
names (``DDPXStrategy``, ``AtomicCheckpointIO``, the ``fabric`` module) are loaded on first use, and the
strategy names (``strategy="ddpx"``, ...) are registered with Lightning as soon as Lightning is imported,
before or after this package. Layers: ``engine/`` <- ``hooks/`` <- ``fault/`` <- ``lightning/``; tooling in
``bench/``; see docs/dev/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_ddpx import _import_hooks
from lightning_ddpx.engine.agreement.replica_check import ReplicaMismatchError, ReplicaReport
from lightning_ddpx.engine.agreement.sequence_check import CollectiveMismatchError
from lightning_ddpx.engine.buckets.grad_bucket import (
    GradBucket,
    collectives_issued_on_call,
    record_bytes_sent,
)
from lightning_ddpx.engine.buckets.plan import BucketInfo
from lightning_ddpx.engine.compile import GraphSplit, compile_model, compiled_graphs
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.engine.reducer.comm_stats import CommStatsSummary, StepCommStats
from lightning_ddpx.engine.reducer.late_gradients import LocalGradientWarning

if TYPE_CHECKING:
    from lightning_ddpx.lightning.checkpoints.checkpoint_io import AtomicCheckpointIO
    from lightning_ddpx.lightning.features.uneven import UnevenInputsError
    from lightning_ddpx.lightning.strategies.trainer import DDPXStrategy

__all__ = [
    "AtomicCheckpointIO",
    "BucketInfo",
    "CollectiveMismatchError",
    "CommStatsSummary",
    "DDPXStrategy",
    "DistributedDataParallel",
    "GradBucket",
    "GraphSplit",
    "LocalGradientWarning",
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
    "AtomicCheckpointIO": "lightning_ddpx.lightning.checkpoints.checkpoint_io",
    "DDPXStrategy": "lightning_ddpx.lightning.strategies.trainer",
    "UnevenInputsError": "lightning_ddpx.lightning.features.uneven",
}
_SUBPACKAGES = ("bench", "engine", "fabric", "hooks", "lightning")

# Module paths from before the layers (0.1.0's flat package) and from before the engine's rooms (its flat
# engine/ folder) -> where the module lives now. Old pickles of a wrapped model name these paths.
_ENGINE_ROOMS = {
    "accumulator_hooks": "reducer.accumulator_hooks",
    "backend_support": "transport.backend_support",
    "backward_start": "reducer.backward_start",
    "bucket_plan": "buckets.replanning",
    "bucket_results": "reducer.bucket_results",
    "bucketing": "buckets.plan",
    "buckets": "buckets.storage",
    "cgroup_memory": "transport.cgroup_memory",
    "comm_stats": "reducer.comm_stats",
    "consistency": "agreement.consistency",
    "cuda_streams": "transport.cuda_streams",
    "diagnosis": "agreement.progress_board",
    "errors": "agreement.errors",
    "grad_bucket": "buckets.grad_bucket",
    "graph": "reducer.reachability",
    "hook_signature": "transport.hook_signature",
    "join": "module.join",
    "launcher": "transport.launcher",
    "module": "module.data_parallel",
    "optim_in_backward": "optim.in_backward",
    "optimizer_overlap": "optim.overlap",
    "pickling": "module.pickling",
    "piecewise_step": "optim.piecewise_step",
    "placement": "module.placement",
    "rank_settings": "module.rank_settings",
    "reducer": "reducer.reducer",
    "reducer_messages": "reducer.messages",
    "replica_check": "agreement.replica_check",
    "results_in_order": "reducer.results_in_order",
    "shared_memory": "transport.shared_memory",
    "sparse": "buckets.sparse",
    "static_graph": "reducer.static_graph",
    "synced_buffers": "module.synced_buffers",
    "trainable_set": "module.trainable_set",
    "transport": "transport.transports",
    "unsupported_options": "module.unsupported_options",
    "usage_log": "reducer.usage_log",
    "used_parameters": "reducer.used_parameters",
}
# The Lightning layer's modules from before its rooms -> <room>.<module>.
_LIGHTNING_ROOMS = {
    "checkpoint_io": "checkpoints.checkpoint_io",
    "checkpoint_state": "checkpoints.checkpoint_state",
    "compile": "features.compile",
    "config": "settings.config",
    "ddp_kwargs": "settings.ddp_kwargs",
    "diloco_setup": "features.diloco_setup",
    "fabric": "strategies.fabric",
    "fabric_run": "runs.fabric_run",
    "fault_tolerance_launch": "fault_tolerance.launch",
    "fault_tolerance_metrics": "fault_tolerance.metrics",
    "fault_tolerance_options": "settings.fault_tolerance_options",
    "fault_tolerance_setup": "fault_tolerance.runs",
    "fault_tolerance_state": "fault_tolerance.state",
    "local_replicas": "checkpoints.local_replicas",
    "optimizer_overlap_setup": "features.optimizer_overlap_setup",
    "options": "settings.options",
    "popen_launcher": "processes.popen_launcher",
    "post_local_sgd_setup": "features.post_local_sgd_setup",
    "process_exit": "processes.process_exit",
    "replica_verification": "features.replica_verification",
    "restart_rendezvous": "processes.restart_rendezvous",
    "strategy": "strategies.trainer",
    "trainer_run": "runs.trainer_run",
    "uneven": "features.uneven",
}
_MOVED_MODULES = {
    **{
        f"lightning_ddpx.{name}": f"lightning_ddpx.engine.{_ENGINE_ROOMS.get(name, name)}"
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
    # the engine's modules whose old name is not now a room's (engine.module, engine.reducer... are rooms)
    **{
        f"lightning_ddpx.engine.{name}": f"lightning_ddpx.engine.{room}"
        for name, room in _ENGINE_ROOMS.items()
        if name not in ("buckets", "module", "reducer", "transport")
    },
    **{
        f"lightning_ddpx.{name}": f"lightning_ddpx.lightning.{_LIGHTNING_ROOMS[name]}"
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
    # the Lightning layer's modules from before its rooms (its flat lightning/ folder)
    **{
        f"lightning_ddpx.lightning.{name}": f"lightning_ddpx.lightning.{room}"
        for name, room in _LIGHTNING_ROOMS.items()
    },
    "lightning_ddpx.distributed": "lightning_ddpx.engine.module.data_parallel",
    "lightning_ddpx.model_averaging": "lightning_ddpx.hooks.model_averaging",
    "lightning_ddpx.netns": "lightning_ddpx.bench.netns",
    "lightning_ddpx.hooks.backend_support": "lightning_ddpx.engine.transport.backend_support",
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
    importlib.import_module("lightning_ddpx.lightning.strategies.trainer")
    importlib.import_module("lightning_ddpx.lightning.strategies.fabric")


_import_hooks.alias_moved_modules(_MOVED_MODULES)
_import_hooks.register_when_imported("lightning.pytorch", _register_strategy_names)
