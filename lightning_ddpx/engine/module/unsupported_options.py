"""torch DDP arguments this module accepts at their defaults only, each refused by name otherwise.

torch 2.13's ``DistributedDataParallel`` takes a few arguments for features this engine does not implement.
They are in our signature so that code passing them explicitly at torch's default (``None``) runs unchanged;
any other value raises before any work, naming the argument and what to use instead, rather than being
silently ignored (which would train differently from what was asked). The strategies refuse them with the
same reasons (:data:`lightning_ddpx.lightning.settings.ddp_kwargs.REFUSED`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["UNSUPPORTED_TORCH_ARGUMENTS", "refuse_unsupported_arguments"]

UNSUPPORTED_TORCH_ARGUMENTS: dict[str, str] = {
    "delay_all_reduce_named_params": (
        "every trainable parameter is reduced in the buckets; torch's separate, delayed all-reduce of named "
        "parameters is not implemented. Remove it or leave it None (the gradients are the same, only their "
        "timing differs), or set requires_grad=False on parameters you reduce yourself."
    ),
    "param_to_hook_all_reduce": (
        "it only applies together with delay_all_reduce_named_params, which is not implemented. Remove it or "
        "leave it None."
    ),
    "mixed_precision": (
        "torch's private _MixedPrecision config is not supported. Use torch.autocast (Lightning: "
        "precision='bf16-mixed' or '16-mixed') for mixed-precision compute, and the fp16/bf16 communication "
        "hooks or their wrappers to compress communication."
    ),
    "device_mesh": (
        "this module replicates over one process group. Pass process_group= instead (for a 1-D mesh: "
        "device_mesh.get_group())."
    ),
    "bucket_cap_mb_list": (
        "per-bucket caps are not supported. Use first_bucket_cap_mb (the first bucket) and bucket_cap_mb "
        "(every other bucket)."
    ),
}


def refuse_unsupported_arguments(**arguments: Any) -> None:
    """Raise ``ValueError`` for the first of ``arguments`` (names from :data:`UNSUPPORTED_TORCH_ARGUMENTS`)
    that is not ``None``."""
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(
                f"lightning_ddpx.DistributedDataParallel: torch's argument {name}={value!r} is not supported: "
                f"{UNSUPPORTED_TORCH_ARGUMENTS[name]}"
            )
