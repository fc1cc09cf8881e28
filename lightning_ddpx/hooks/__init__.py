"""Communication hooks for :class:`lightning_ddpx.DistributedDataParallel` (and torch's DDP).

See ``docs/hooks.md`` for what each hook does and when to use it.
"""

from lightning_ddpx.hooks.default import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from lightning_ddpx.hooks.diloco import DiLoCoOptions, DiLoCoState
from lightning_ddpx.hooks.post_local_sgd import PostLocalSGDOptions, PostLocalSGDState, post_local_sgd_hook
from lightning_ddpx.hooks.powersgd import (
    CompressionStats,
    PowerSGDOptions,
    PowerSGDState,
    batched_powersgd_hook,
    powersgd_hook,
)
from lightning_ddpx.hooks.registry import available_hooks, build_comm_hook, register_hook_name

__all__ = [
    "CompressionStats",
    "DiLoCoOptions",
    "DiLoCoState",
    "PostLocalSGDOptions",
    "PostLocalSGDState",
    "PowerSGDOptions",
    "PowerSGDState",
    "allreduce_hook",
    "available_hooks",
    "batched_powersgd_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "build_comm_hook",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "post_local_sgd_hook",
    "powersgd_hook",
    "register_hook_name",
]
