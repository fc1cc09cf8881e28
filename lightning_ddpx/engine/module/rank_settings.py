"""What every rank must have alike before its first synchronised backward, as text to compare.

A rank with another bucket cap, hook, hook option or transport issues other collectives than its peers:
the first sign would be a hang or a crash inside the backend steps later. The module describes its
settings here (each as text that is the same on every rank when the setting is: names, never addresses),
and :func:`~lightning_ddpx.engine.agreement.consistency.verify_same_settings` compares them once, naming the first
that differs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from lightning_ddpx.engine.transport.transports import hook_name

if TYPE_CHECKING:
    from lightning_ddpx.engine.reducer.reducer import Reducer

__all__ = ["SETTING_OPTIONS", "module_settings"]

# The module's options that change its collectives, by their attribute names.
SETTING_OPTIONS = (
    "bucket_cap_mb",
    "first_bucket_cap_mb",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "broadcast_buffers",
    "static_graph",
)

# Options of hook states that must agree across ranks, by torch's and our names (PowerSGD, post-local SGD).
_HOOK_OPTION_NAMES = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "random_seed",
    "batch_tensors_with_same_shape",
    "start_localSGD_iter",
    "post_local_gradient_allreduce",
    "period",
)


def module_settings(
    options: Mapping[str, Any], reducer: Reducer, hook_registered: bool, driver_settings: Mapping[str, str]
) -> dict[str, str]:
    """The settings of a module with these ``options`` (:data:`SETTING_OPTIONS`) reducing through
    ``reducer``, and those of whoever drives it (``driver_settings``: a strategy's options)."""
    settings = {name: repr(value) for name, value in options.items()}
    transport = reducer.transport
    settings["comm_hook"] = hook_name(transport.hook) if hook_registered else "None (mean allreduce)"
    settings["transport"] = transport.describe()  # the collectives each bucket takes
    settings["DDPX_DEBUG"] = repr(reducer.progress.debug)  # one all-gather per bucket when on
    settings["overlap_optimizer"] = repr(reducer.overlap is not None)  # it changes the bucket plan
    # sparse embeddings get buckets of their own: a different sparse flag on one rank means other buckets
    settings["sparse gradients"] = repr(
        [name for name, sparse in zip(reducer.names, reducer.sparse_gradients) if sparse]
    )
    if hook_registered:
        settings.update(_hook_state_settings(transport.state))
    settings.update(driver_settings)
    return settings


def _hook_state_settings(state: Any) -> dict[str, str]:
    """The hook state's type and options (from ``state.options`` if it is a dataclass, else known names)."""
    settings = {"comm_hook state": f"{type(state).__module__}.{type(state).__qualname__}"}
    options = getattr(state, "options", None)
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        values = dataclasses.asdict(options)
    else:
        values = {name: getattr(state, name) for name in _HOOK_OPTION_NAMES if hasattr(state, name)}
    for name, value in values.items():
        if isinstance(value, (bool, int, float, str, type(None), tuple, list)):
            settings[f"comm_hook option {name}"] = repr(value)
    return settings
