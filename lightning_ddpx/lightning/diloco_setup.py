"""What both strategies do for DiLoCo: check the options, bind the state to the model, log the outer syncs.

``comm_hook="diloco"`` with ``diloco={...}`` (:class:`~lightning_ddpx.hooks.diloco.DiLoCoOptions`, a dict in
YAML) registers a hook that keeps every rank's gradients local, and a
:class:`~lightning_ddpx.hooks.diloco.DiLoCoState` whose ``averager`` the strategies run after each optimizer
step, exactly where post-local SGD's model averager runs (:mod:`lightning_ddpx.lightning.post_local_sgd_setup`):
the same optimizer checks, the same per-rank weights and optimizer states in checkpoints.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning_ddpx.hooks.diloco import DiLoCoOptions, DiLoCoState

__all__ = ["HOOK_NAME", "attach", "finish", "log_outer_syncs", "outer_sync_metrics", "resolve_options"]

HOOK_NAME = "diloco"


def resolve_options(
    comm_hook: Any, options: Union[DiLoCoOptions, dict[str, Any], None], comm_wrapper: Optional[str]
) -> Optional[DiLoCoOptions]:
    """Validate a strategy's DiLoCo options (in its constructor); ``None`` unless ``comm_hook="diloco"``."""
    if options is not None and comm_hook != HOOK_NAME:
        raise ValueError(
            f"DDPXStrategy: diloco options are given but comm_hook is {comm_hook!r}. Set comm_hook='{HOOK_NAME}' "
            "or drop diloco=..."
        )
    if comm_hook != HOOK_NAME:
        return None
    if comm_wrapper is not None:
        raise ValueError(
            f"DDPXStrategy: comm_wrapper={comm_wrapper!r} with comm_hook='{HOOK_NAME}': DiLoCo sends no gradients "
            f"to compress. To send the outer delta in low precision use diloco={{'precision': '{comm_wrapper}'}}."
        )
    if options is None:
        return DiLoCoOptions()
    if isinstance(options, DiLoCoOptions):
        return options
    if isinstance(options, dict):
        try:
            return DiLoCoOptions.from_dict(options)
        except (TypeError, ValueError) as error:
            raise type(error)(f"DDPXStrategy: diloco={options!r}: {error}") from None
    raise TypeError(
        f"DDPXStrategy: diloco must be a DiLoCoOptions or a dict of its fields, got {type(options).__name__}."
    )


def attach(state: Any, module: Any) -> None:
    """Bind a DiLoCo state to the wrapped ``module``'s trainable parameters (after its initial broadcast, so
    every rank starts from rank 0's values as anchors). Other states: nothing."""
    if isinstance(state, DiLoCoState):
        state.attach(module.module.parameters())


def outer_sync_metrics(source: Any) -> list[dict[str, float]]:
    """One metrics dict per outer exchange sent since the last call: its payload bytes
    (``ddpx/outer_sync_bytes``), the fragment, and the run's total so far (``ddpx/outer_bytes_total``).

    ``source`` is a DiLoCo state, our module, or the model ``fabric.setup`` returned (Fabric's loop logs
    them: ``for m in outer_sync_metrics(model): fabric.log_dict(m)``). Anything else: no metrics.
    """
    module = getattr(source, "_forward_module", source)  # fabric.setup wraps our module
    state = getattr(module, "comm_hook_state", module)
    if not isinstance(state, DiLoCoState):
        return []
    total = state.bytes_sent
    syncs = state.take_syncs()
    metrics, before = [], total - sum(sync.bytes_sent for sync in syncs)
    for sync in syncs:
        before += sync.bytes_sent
        metrics.append(
            {
                "ddpx/outer_sync_bytes": float(sync.bytes_sent),
                "ddpx/outer_sync_fragment": float(sync.fragment),
                "ddpx/outer_bytes_total": float(before),
            }
        )
    return metrics


def log_outer_syncs(state: Any, trainer: Any) -> None:
    """Log :func:`outer_sync_metrics` to the Trainer's loggers (rank-zero-only loggers write rank 0's)."""
    for metrics in outer_sync_metrics(state):
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def finish(state: Any) -> None:
    """Wait for DiLoCo exchanges still in flight (at the end of training); other states: nothing."""
    if isinstance(state, DiLoCoState):
        state.finish()
