"""``overlap_optimizer=True`` in the strategies: Lightning's optimizer steps inside backward, bucket by bucket.

The engine's :meth:`~lightning_ddpx.DistributedDataParallel.overlap_optimizer_with` does the work (see
:mod:`lightning_ddpx.engine.optim.overlap`); this module fits it into Lightning's optimizer loop:

- **Trainer**: the configured optimizer is handed to the module at setup. ``optimizer_step`` runs
  Lightning's closure (forward, backward -- during which the buckets step -- then the
  ``on_before_optimizer_step`` hooks) and does not call ``optimizer.step()`` again. With
  ``accumulate_grad_batches`` Lightning runs the non-boundary backwards inside ``no_sync()``, so only the
  boundary's backward steps. LR schedulers keep working: the bucket steps read the live ``lr``.
- **Fabric**: ``setup_optimizer`` hands the optimizer to the module that owns its parameters;
  ``optimizer.step()`` after a backward that already stepped does nothing, so Fabric loops stay unchanged.

Refused, at setup and naming the option: gradient clipping (``gradient_clip_val``, an overridden
``configure_gradient_clipping``, ``fabric.clip_gradients``) and gradient scaling (``16-mixed`` with a
GradScaler), which need every gradient before any parameter is updated; manual optimisation and several
optimizers, whose steps Lightning does not drive through ``optimizer_step`` with one closure.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.lightning._compat import unwrapped_optimizer, wrap_closure

__all__ = ["attach_fabric_optimizer", "attach_trainer_optimizer", "refuse_clipping", "step_with_closure"]

_NEEDS_ALL = "needs every gradient before any parameter is updated, but overlap_optimizer=True updates each "


def check_option(overlap_optimizer: Any, post_local_sgd_configured: bool) -> None:
    """Constructor-time checks of the option itself (no process group)."""
    if not isinstance(overlap_optimizer, bool):
        raise TypeError(f"DDPXStrategy: overlap_optimizer must be True or False, got {overlap_optimizer!r}.")
    if overlap_optimizer and post_local_sgd_configured:
        raise ValueError(
            "DDPXStrategy: overlap_optimizer=True cannot be combined with post-local SGD (post_local_sgd / a "
            "PostLocalSGDState) or DiLoCo (comm_hook='diloco'): that combination is not implemented or tested. "
            "Drop one of the two options."
        )


def _refuse_scaler(precision: Any) -> None:
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(
            f"DDPXStrategy: overlap_optimizer=True with a gradient scaler ({type(precision).__name__}, "
            f"'16-mixed'): unscaling and the inf/NaN check {_NEEDS_ALL}bucket as soon as it is reduced. Use "
            "precision='bf16-mixed' (no scaler) or overlap_optimizer=False."
        )


def attach_trainer_optimizer(
    module: DistributedDataParallel, trainer: Any, optimizers: list[Any], precision: Any
) -> None:
    """Check the Trainer's configuration and hand its one optimizer to ``module`` (called at setup)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    pl_module = trainer.lightning_module
    if not pl_module.automatic_optimization:
        raise ValueError(
            "DDPXStrategy: overlap_optimizer=True needs automatic optimization, but the LightningModule sets "
            "automatic_optimization=False: with manual_backward and your own optimizer.step() calls the strategy "
            "cannot tell which backward should step which optimizer. Use overlap_optimizer=False."
        )
    if len(optimizers) != 1:
        raise ValueError(
            f"DDPXStrategy: overlap_optimizer=True needs exactly one optimizer from configure_optimizers, got "
            f"{len(optimizers)}. Return one optimizer, or use overlap_optimizer=False."
        )
    clip = trainer.gradient_clip_val
    if clip is not None and clip > 0:
        raise ValueError(
            f"DDPXStrategy: overlap_optimizer=True and Trainer(gradient_clip_val={clip}) do not go together: "
            f"clipping {_NEEDS_ALL}bucket as soon as it is reduced. Remove gradient_clip_val, or use "
            "overlap_optimizer=False."
        )
    if is_overridden("configure_gradient_clipping", pl_module):
        raise ValueError(
            f"DDPXStrategy: overlap_optimizer=True and {type(pl_module).__name__}.configure_gradient_clipping "
            f"do not go together: it runs after backward, when the parameters were already updated, and "
            f"clipping {_NEEDS_ALL}bucket. Remove the override, or use overlap_optimizer=False."
        )
    _refuse_scaler(precision)
    module.overlap_optimizer_with(_unwrap_optimizer(optimizers[0]))


def step_with_closure(
    precision: Any, module: Any, model: Any, optimizer: Any, closure: Callable[[], Any], **kwargs: Any
) -> Any:
    """The Trainer's ``optimizer_step`` with overlap: run the closure, step only if backward did not.

    ``Precision._wrap_closure`` (:func:`~lightning_ddpx.lightning._compat.wrap_closure`) is what ``Precision.optimizer_step`` hands to ``optimizer.step``: the closure,
    then the ``on_before_optimizer_step`` hooks (they see the gradients; the parameters are already
    updated). A backward that did not synchronise (``training_step`` returned ``None``) stepped nothing:
    then the plain step runs, as with ``strategy="ddp"``.
    """
    result = wrap_closure(precision, model, optimizer, closure)
    if not (isinstance(module, DistributedDataParallel) and module.optimizer_stepped_in_backward):
        optimizer.step(**kwargs)
    return result


def attach_fabric_optimizer(
    modules: Iterable[DistributedDataParallel], optimizer: Any, precision: Any
) -> None:
    """Fabric: hand ``optimizer`` to the set-up module that owns its parameters."""
    _refuse_scaler(precision)
    raw = _unwrap_optimizer(optimizer)
    owned = {id(p) for group in raw.param_groups for p in group["params"]}
    owners = [m for m in modules if any(id(p) in owned for p in m.module.parameters())]
    if len(owners) != 1:
        raise ValueError(
            f"DDPXStrategy: overlap_optimizer=True needs the optimizer's parameters to belong to one model set up "
            f"by this strategy, found {len(owners)}. Set up the model first (fabric.setup(model, optimizer) does), "
            "with one optimizer per model, or use overlap_optimizer=False."
        )
    owners[0].overlap_optimizer_with(raw)


def stepped_in_backward(modules: Iterable[DistributedDataParallel], optimizer: Any) -> bool:
    """Fabric: whether the last synchronised backward of ``optimizer``'s module already stepped it."""
    raw = _unwrap_optimizer(optimizer)
    return any(m.overlapped_optimizer is raw and m.optimizer_stepped_in_backward for m in modules)


def refuse_clipping(overlap_optimizer: bool, what: str) -> None:
    if overlap_optimizer:
        raise ValueError(
            f"DDPXStrategy: {what} with overlap_optimizer=True: clipping {_NEEDS_ALL}bucket during backward, "
            "so clipping afterwards would change nothing. Use overlap_optimizer=False to clip."
        )


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under Lightning's ``LightningOptimizer`` / Fabric's ``_FabricOptimizer``."""
    inner = unwrapped_optimizer(optimizer)
    return inner if inner is not optimizer else getattr(optimizer, "optimizer", optimizer)
