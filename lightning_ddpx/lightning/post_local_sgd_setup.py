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

from typing import Any, Iterable, Optional, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post_local_sgd

from lightning_ddpx.hooks.diloco import DiLoCoState
from lightning_ddpx.hooks.model_averaging import ModelAverager, PeriodicModelAverager
from lightning_ddpx.hooks.post_local_sgd import PostLocalSGDOptions, PostLocalSGDState, from_torch_state

__all__ = ["adopt_torch_state", "averager_for", "average_after_step", "check_optimizers", "resolve_options"]

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
    options: Union[PostLocalSGDOptions, dict[str, Any], None],
    model_averaging_period: Optional[int],
) -> Optional[PostLocalSGDOptions]:
    """Validate the post-local SGD options of a strategy (in its constructor) and return them, with
    ``model_averaging_period`` filled in as ``period`` for the named hook."""
    if model_averaging_period is not None and (
        isinstance(model_averaging_period, bool)
        or not isinstance(model_averaging_period, int)
        or model_averaging_period < 1
    ):
        raise ValueError(
            f"DDPXStrategy: model_averaging_period must be a positive number of steps or None, got "
            f"{model_averaging_period!r}."
        )
    if options is not None and comm_hook != HOOK_NAME:
        raise ValueError(
            f"DDPXStrategy: post_local_sgd options are given but comm_hook is {comm_hook!r}. Set "
            f"comm_hook='{HOOK_NAME}' or drop post_local_sgd=..."
        )
    if comm_hook == HOOK_NAME:
        if isinstance(options, dict):
            try:
                options = PostLocalSGDOptions.from_dict(options)
            except (TypeError, ValueError) as error:
                raise type(error)(f"DDPXStrategy: post_local_sgd={options!r}: {error}") from None
        elif options is None:
            options = PostLocalSGDOptions()
        elif not isinstance(options, PostLocalSGDOptions):
            raise TypeError(
                "DDPXStrategy: post_local_sgd must be a PostLocalSGDOptions or a dict of its fields, got "
                f"{type(options).__name__}."
            )
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


def averager_for(hook_state: Any, model_averaging_period: Optional[int]) -> Optional[ModelAverager]:
    """The averager to run after each optimizer step, or ``None`` when the hook is not post-local SGD
    (or DiLoCo, whose outer step runs at the same place)."""
    if isinstance(hook_state, DiLoCoState):
        return hook_state.averager
    if isinstance(hook_state, PostLocalSGDState):
        if hook_state.averager is None and model_averaging_period is not None:
            hook_state.set_period(model_averaging_period)
        hook_state.resolve()  # builds the averager if the groups were not made yet
        return hook_state.averager
    if isinstance(hook_state, torch_post_local_sgd.PostLocalSGDState) and model_averaging_period is not None:
        # torch's state with a hook of the user's own: only the averager is ours (not in checkpoints).
        return PeriodicModelAverager(
            model_averaging_period, hook_state.start_localSGD_iter, hook_state.process_group
        )
    return None


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
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer / _FabricOptimizer
        if isinstance(inner, refused):
            raise ValueError(
                f"DDPXStrategy: post-local SGD model averaging cannot work with a {type(inner).__name__}: it "
                "shards or averages parameters itself. Use a plain optimizer (e.g. torch.optim.SGD); the "
                "strategy averages the model every model_averaging_period steps."
            )


def average_after_step(averager: ModelAverager, optimizers: Iterable[Any], module: torch.nn.Module) -> bool:
    """Count one optimizer step (of any of ``optimizers``); when due, average every parameter of ``module``
    that one of ``optimizers`` updates, each once, with or without a gradient at this step.

    Lightning's DDPStrategy averages only the stepping optimizer's parameters that have a gradient. Then the
    ranks drift apart silently in two cases. With several optimizers taking turns (a GAN, manual
    optimisation), the due steps can always fall on the same optimizer. A parameter without a gradient at a
    due step (unused in that batch, or its optimizer's ``zero_grad`` already ran) is skipped, though earlier
    local steps moved it. With one optimizer whose parameters all have gradients, the two rules average the
    same parameters.
    """
    params: list[torch.Tensor] = []
    if averager.group_due() is not False:  # collected only when due: this runs after every step
        own, seen = {id(p) for p in module.parameters()}, set()
        for optimizer in optimizers:
            for group in getattr(optimizer, "_optimizer", optimizer).param_groups:
                for param in group["params"]:
                    if id(param) in own and id(param) not in seen:
                        seen.add(id(param))
                        params.append(param)
    return averager.average_parameters(params, only_with_grad=False)


def params_of(optimizer: Any) -> set[int]:
    inner = getattr(optimizer, "_optimizer", optimizer)
    return {id(p) for group in inner.param_groups for p in group["params"]}


def owns_params(module: torch.nn.Module, optimizer: Any) -> bool:
    """Whether ``optimizer`` updates any of ``module``'s parameters."""
    ids = params_of(optimizer)
    return any(id(p) in ids for p in module.parameters())
