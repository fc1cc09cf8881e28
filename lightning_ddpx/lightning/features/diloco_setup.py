"""What both strategies do for DiLoCo: check the options, log the outer syncs.

``comm_hook="diloco"`` with ``diloco={...}`` (:class:`~lightning_ddpx.hooks.diloco.DiLoCoOptions`, a dict in
YAML) registers a hook that keeps every rank's gradients local, and a
:class:`~lightning_ddpx.hooks.diloco.DiLoCoState` whose outer step the module binds to its parameters when
the hook is registered. The strategies run it after each optimizer step through the module's parameter
averaging, exactly as post-local SGD's model averager (:func:`~lightning_ddpx.lightning.features.post_local_sgd_setup.average_after_step`):
the same optimizer checks, the same per-rank weights and optimizer states in checkpoints.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_ddpx.hooks.diloco import DiLoCoOptions, DiLoCoState
from lightning_ddpx.lightning._compat import forward_module

__all__ = ["HOOK_NAME", "log_outer_syncs", "outer_sync_metrics", "resolve_options"]

HOOK_NAME = "diloco"


def resolve_options(
    comm_hook: Any, options: Optional[DiLoCoOptions], comm_wrapper: Optional[str]
) -> Optional[DiLoCoOptions]:
    """Complete a strategy's DiLoCo options (in its constructor); ``None`` unless ``comm_hook="diloco"``.
    ``options`` come parsed, and only with the hook that takes them (the hook registry's rule, applied by
    ``DDPXConfig``)."""
    if comm_hook != HOOK_NAME:
        return None
    if comm_wrapper is not None:
        raise ValueError(
            f"DDPXStrategy: comm_wrapper={comm_wrapper!r} with comm_hook='{HOOK_NAME}': DiLoCo sends no gradients "
            f"to compress. To send the outer delta in low precision use diloco={{'precision': '{comm_wrapper}'}}."
        )
    return options if options is not None else DiLoCoOptions()


def outer_sync_metrics(source: Any) -> list[dict[str, float]]:
    """One metrics dict per outer exchange sent since the last call: its payload bytes
    (``ddpx/outer_sync_bytes``), the bytes that reached this rank in it (``ddpx/outer_sync_bytes_received``:
    an all-reduce's result, or -- for the sparse exchange's all-gather -- every other rank's payload), the
    fragment, and the run's totals so far (``ddpx/outer_bytes_total``, ``ddpx/outer_bytes_received_total``).

    ``source`` is a DiLoCo state, our module, or the model ``fabric.setup`` returned (Fabric's loop logs
    them: ``for m in outer_sync_metrics(model): fabric.log_dict(m)``). Anything else: no metrics.
    """
    module = forward_module(source)  # fabric.setup wraps our module
    state = getattr(module, "comm_hook_state", module)
    if not isinstance(state, DiLoCoState):
        return []
    syncs = state.take_syncs()
    metrics = []
    sent = state.bytes_sent - sum(sync.bytes_sent for sync in syncs)
    received = state.bytes_received - sum(sync.bytes_received for sync in syncs)
    for sync in syncs:
        sent += sync.bytes_sent
        received += sync.bytes_received
        metrics.append(
            {
                "ddpx/outer_sync_bytes": float(sync.bytes_sent),
                "ddpx/outer_sync_bytes_received": float(sync.bytes_received),
                "ddpx/outer_sync_fragment": float(sync.fragment),
                "ddpx/outer_bytes_total": float(sent),
                "ddpx/outer_bytes_received_total": float(received),
            }
        )
    return metrics


def log_outer_syncs(state: Any, trainer: Any) -> None:
    """Log :func:`outer_sync_metrics` to the Trainer's loggers (rank-zero-only loggers write rank 0's)."""
    for metrics in outer_sync_metrics(state):
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
