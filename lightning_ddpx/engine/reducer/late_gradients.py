"""Gradients that arrive after the reduction: a backward outside the module's forward, named once.

Once a synchronised backward has averaged every bucket, the reducer expects no gradient until the next
forward. A backward that does not go through the wrapped module's forward (an auxiliary loss computed through
a submodule, ``model.module.sub(x)``, e.g. in Lightning's ``on_after_backward``) still accumulates into
``param.grad``, on this rank only, and the optimizer then steps each rank with different gradients. torch's
reducer ignores gradient hooks that fire while it expects none, so torch's DDP diverges silently; ours sees
the hook fire (:meth:`~lightning_ddpx.engine.reducer.reducer.Reducer._accumulate_locally`, the hook's branch
for gradients outside a synchronised backward) and names the first such gradient, once per module.

A warning, not an error: local gradients are sometimes wanted (input gradients for adversarial examples,
dropped by ``zero_grad`` before the step), and the reducer cannot see ``zero_grad``, so it cannot tell those
from the ones the optimizer will use. The message names the fix and how to silence it.
"""

from __future__ import annotations

import warnings

__all__ = ["LocalGradientWarning", "warn_local_gradient"]


class LocalGradientWarning(UserWarning):
    """A parameter received a gradient on one rank after this iteration's gradients were averaged (a backward
    outside the module's forward); filter this category to silence it where that is intended."""


def warn_local_gradient(name: str, rank: int) -> None:
    warnings.warn(
        f"lightning_ddpx (rank {rank}): parameter {name!r} received a gradient after this iteration's "
        "gradients were averaged across ranks: a backward outside the module's forward (e.g. an auxiliary "
        "loss computed through a submodule, model.module.sub(x), and its own .backward(), as in Lightning's "
        "on_after_backward). That gradient stays on this rank, so the ranks would step with different "
        "gradients (torch's DDP lets this pass silently). Fix: compute the extra loss through the "
        "DistributedDataParallel module's forward, or add it to the main loss before backward(). If these "
        "local gradients are wanted (e.g. input gradients for adversarial examples, dropped by zero_grad() "
        "before the step): compute them with torch.autograd.grad(loss, inputs) or "
        "loss.backward(inputs=[x]), which leave the parameters' gradients alone; or run that backward inside "
        "model.no_sync() (Lightning: trainer.strategy.block_backward_sync()); or silence this warning with "
        "warnings.filterwarnings('ignore', category=lightning_ddpx.LocalGradientWarning). "
        "Shown once per module.",
        LocalGradientWarning,
        stacklevel=2,
    )
