"""What both strategies do for post-local SGD: check the options, build the state, average after each step.

Lightning's ``DDPStrategy`` runs post-local SGD when ``ddp_comm_state`` is torch's ``PostLocalSGDState``:
it then requires ``model_averaging_period`` and averages the optimizer's parameters (those with a gradient)
after every ``optimizer_step``. The strategies here do the same for

- ``comm_hook="post_local_sgd"`` with ``post_local_sgd={...}`` options (``period`` there, or
  ``model_averaging_period``, or a ``hierarchy``);
- ``comm_state`` = our :class:`~lightning_ddpx.hooks.PostLocalSGDState` (its ``period``, or
  ``model_averaging_period``);
- ``comm_state`` = torch's ``PostLocalSGDState`` with ``model_averaging_period``, as in Lightning. With
  torch's ``post_localSGD_hook`` both are replaced by ours (same semantics; it also works on CPU with
  ``subgroup=None`` and goes into checkpoints); with another hook, torch's state stays and only the averager
  is ours.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post_local_sgd

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.hooks.model_averaging import PeriodicModelAverager
from lightning_ddpx.hooks.post_local_sgd import PostLocalSGDOptions, PostLocalSGDState, from_torch_state
from lightning_ddpx.lightning._compat import unwrapped_optimizer

__all__ = [
    "adopt_torch_state",
    "average_after_step",
    "check_optimizers",
    "complete_averaging",
    "resolve_options",
]

HOOK_NAME = "post_local_sgd"

_NO_PERIOD = (
    "DDPXStrategy: post-local SGD is used ({what}) but no model averaging period is given, so the replicas "
    "would drift apart for good after start_localSGD_iter. Pass model_averaging_period=N to the strategy "
    "(or post_local_sgd={{'period': N}}, or a hierarchy)."
)


def _is_post_local_state(state: Any) -> bool:
    return isinstance(state, (PostLocalSGDState, torch_post_local_sgd.PostLocalSGDState))


def resolve_options(
    comm_hook: Any,
    comm_state: Any,
    options: Optional[PostLocalSGDOptions],
    model_averaging_period: Optional[int],
) -> Optional[PostLocalSGDOptions]:
    """Complete the post-local SGD options of a strategy (in its constructor) and return them, with
    ``model_averaging_period`` filled in as ``period`` for the named hook. ``options`` come parsed, and only
    with the hook that takes them (the hook registry's rule, applied by ``DDPXConfig``), as does
    ``model_averaging_period``, checked as a count."""
    if comm_hook == HOOK_NAME:
        options = options if options is not None else PostLocalSGDOptions()
        options = options.with_period(model_averaging_period)
        if options.period is None and options.hierarchy is None:
            raise ValueError(_NO_PERIOD.format(what=f"comm_hook='{HOOK_NAME}'"))
        return options
    if _is_post_local_state(comm_state):
        own_period = getattr(comm_state, "period", None) or getattr(comm_state, "hierarchy", None)
        if model_averaging_period is None and own_period is None:
            raise ValueError(_NO_PERIOD.format(what=f"comm_state is a {type(comm_state).__qualname__}"))
        if (
            model_averaging_period is not None
            and own_period is not None
            and own_period != model_averaging_period
        ):
            raise ValueError(
                f"DDPXStrategy: model_averaging_period={model_averaging_period} conflicts with the comm_state's "
                f"own averaging ({own_period}); give the averaging period in one place."
            )
        return None
    if model_averaging_period is not None:
        rank_zero_warn(
            f"DDPXStrategy: model_averaging_period={model_averaging_period} has no effect without post-local "
            f"SGD (as in Lightning's DDPStrategy). Use comm_hook='{HOOK_NAME}' to average models periodically."
        )
    return None


def is_configured(post_local_sgd: Optional[PostLocalSGDOptions], comm_state: Any) -> bool:
    """Whether a strategy's options (after :func:`resolve_options`) run post-local SGD with averaging."""
    return post_local_sgd is not None or _is_post_local_state(comm_state)


def adopt_torch_state(state: Any, hook: Any, period: Optional[int]) -> tuple[Any, Any]:
    """torch's ``PostLocalSGDState`` + ``post_localSGD_hook`` become ours (same meaning); all else stays."""
    if (
        isinstance(state, torch_post_local_sgd.PostLocalSGDState)
        and hook is torch_post_local_sgd.post_localSGD_hook
    ):
        from lightning_ddpx.hooks.post_local_sgd import post_local_sgd_hook

        return from_torch_state(state, period), post_local_sgd_hook
    return state, hook


def complete_averaging(
    module: DistributedDataParallel, hook_state: Any, model_averaging_period: Optional[int]
) -> None:
    """Lightning's ``model_averaging_period`` for a post-local SGD state given without one, once its hook is
    registered: our ``PostLocalSGDState`` takes it as its ``period`` (its averager then goes into checkpoints
    with the state); torch's, with a hook of the user's own, gets our ``PeriodicModelAverager`` (not in
    checkpoints). Either is registered with the module, which runs it after each optimizer step. A state that
    brought its own averaging (the named hooks, a state with a period) needs nothing here."""
    if module.parameter_averaging is not None or model_averaging_period is None:
        return
    if isinstance(hook_state, PostLocalSGDState):
        hook_state.set_period(model_averaging_period)
        averaging = hook_state.parameter_averaging()
    elif isinstance(hook_state, torch_post_local_sgd.PostLocalSGDState):
        averaging = PeriodicModelAverager(
            model_averaging_period, hook_state.start_localSGD_iter, hook_state.process_group
        )
    else:
        return
    if averaging is not None:
        module.register_parameter_averaging(averaging)


def check_optimizers(optimizers: Iterable[Any]) -> None:
    """Refuse optimizers that shard or average by themselves, as Lightning's DDPStrategy does."""
    from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

    refused: tuple[type, ...] = (PostLocalSGDOptimizer, ZeroRedundancyOptimizer)
    try:
        from torch.distributed.optim import DistributedOptimizer

        refused = (*refused, DistributedOptimizer)
    except ImportError:  # not built on every platform
        pass
    for optimizer in optimizers:
        inner = unwrapped_optimizer(optimizer)  # LightningOptimizer / _FabricOptimizer
        if isinstance(inner, refused):
            raise ValueError(
                f"DDPXStrategy: post-local SGD model averaging cannot work with a {type(inner).__name__}: it "
                "shards or averages parameters itself. Use a plain optimizer (e.g. torch.optim.SGD); the "
                "strategy averages the model every model_averaging_period steps."
            )


def average_after_step(module: DistributedDataParallel, optimizers: Iterable[Any]) -> bool:
    """The module's parameter averaging after one optimizer step (of any of ``optimizers``): post-local SGD,
    when due, averages every parameter of ``module`` that one of ``optimizers`` updates, each once, with or
    without a gradient at this step; DiLoCo takes its outer step when due.

    Lightning's DDPStrategy averages only the stepping optimizer's parameters that have a gradient. Then the
    ranks drift apart silently in two cases. With several optimizers taking turns (a GAN, manual
    optimisation), the due steps can always fall on the same optimizer. A parameter without a gradient at a
    due step (unused in that batch, or its optimizer's ``zero_grad`` already ran) is skipped, though earlier
    local steps moved it. With one optimizer whose parameters all have gradients, the two rules average the
    same parameters.
    """
    return module.average_parameters_after_step([unwrapped_optimizer(o) for o in optimizers])


def params_of(optimizer: Any) -> set[int]:
    inner = unwrapped_optimizer(optimizer)
    return {id(p) for group in inner.param_groups for p in group["params"]}


def owns_params(module: torch.nn.Module, optimizer: Any) -> bool:
    """Whether ``optimizer`` updates any of ``module``'s parameters."""
    ids = params_of(optimizer)
    return any(id(p) in ids for p in module.parameters())
