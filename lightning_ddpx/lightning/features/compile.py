"""``Trainer.fit(torch.compile(module))`` with our module: the compiled training step, split at bucket
boundaries (:mod:`lightning_ddpx.engine.compile` does the splitting; this reads what Lightning recorded)."""

from __future__ import annotations

from typing import Any

from lightning_ddpx._compat import torch as torch_compat
from lightning_ddpx.engine.compile import PlanAwareCompiled
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.lightning._compat import compiler_context

__all__ = ["apply_lightning_compile"]


def apply_lightning_compile(ddp_model: DistributedDataParallel, split: bool = True) -> bool:
    """Give a LightningModule compiled with ``torch.compile`` the bucket-aligned split; the strategy calls it.

    ``Trainer.fit(torch.compile(module))`` makes Lightning wrap ``forward`` and the ``*_step`` methods with the
    user's dynamo context. Those run inside our wrapper's forward, so bookkeeping stays out of the graph and
    results are right as they are; this replaces ``training_step`` by a split-compiled one with the same
    backend (validation and test steps keep Lightning's: no backward, nothing to overlap). Returns whether
    the module was compiled. The backend carries ``mode`` and ``options``; ``fullgraph`` and ``dynamic`` are
    carried over too.
    """
    module = ddp_model.module
    context = compiler_context(module)
    if not isinstance(context, dict) or context.get("compiler") != "dynamo":
        return False
    dynamo_ctx = context["dynamo_ctx"]
    backend = torch_compat.innermost_backend(
        dynamo_ctx.callback
    )  # carries mode/options (e.g. inductor's wrapper)
    original = context["original_training_step"]
    compile_kwargs = _user_compile_options(dynamo_ctx)
    module.training_step = PlanAwareCompiled(original, ddp_model, backend, split, compile_kwargs)  # type: ignore[method-assign]
    return True


def _user_compile_options(dynamo_ctx: Any) -> dict[str, Any]:
    """``fullgraph`` and ``dynamic`` of the user's ``torch.compile`` call, read off its dynamo context."""
    options: dict[str, Any] = {}
    if getattr(dynamo_ctx, "fullgraph", False):
        options["fullgraph"] = True
    dynamic = torch_compat.dynamic_of(dynamo_ctx)
    if dynamic is not None:
        options["dynamic"] = dynamic
    return options
