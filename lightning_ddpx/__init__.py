"""lightning-ddpx: a data-parallel module on our own bucketed gradient reducer, and its Lightning strategy."""

from lightning_ddpx import fabric  # noqa: F401 - registers "ddpx", ... with Fabric (its own DDPXStrategy)
from lightning_ddpx.bucketing import BucketInfo
from lightning_ddpx.checkpoint_io import AtomicCheckpointIO
from lightning_ddpx.comm_stats import CommStatsSummary, StepCommStats
from lightning_ddpx.compile import GraphSplit, compile_model, compiled_graphs
from lightning_ddpx.diagnosis import CollectiveMismatchError
from lightning_ddpx.distributed import DistributedDataParallel
from lightning_ddpx.grad_bucket import GradBucket, collectives_issued_on_call, record_bytes_sent
from lightning_ddpx.strategy import DDPXStrategy  # registers "ddpx", "ddpx_powersgd", ... with Lightning
from lightning_ddpx.uneven import UnevenInputsError

__all__ = [
    "AtomicCheckpointIO",
    "BucketInfo",
    "CollectiveMismatchError",
    "CommStatsSummary",
    "DDPXStrategy",
    "DistributedDataParallel",
    "GradBucket",
    "GraphSplit",
    "StepCommStats",
    "UnevenInputsError",
    "collectives_issued_on_call",
    "compile_model",
    "compiled_graphs",
    "record_bytes_sent",
]
__version__ = "0.1.0"
