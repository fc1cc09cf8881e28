"""lightning-ddpx: a data-parallel module on our own bucketed gradient reducer, and its Lightning strategy."""

from lightning_ddpx.bucketing import BucketInfo
from lightning_ddpx.distributed import DistributedDataParallel
from lightning_ddpx.grad_bucket import GradBucket, collectives_issued_on_call

__all__ = ["BucketInfo", "DistributedDataParallel", "GradBucket", "collectives_issued_on_call"]
__version__ = "0.1.0"
