"""When a parameter's gradient is final for this backward: a hook on its gradient accumulator, as torch's.

torch's reducer marks a gradient ready from a post-hook on the parameter's ``AccumulateGrad`` node, not from
a hook on the tensor. The autograd engine runs a node's post-hooks after the hooks registered on the tensor
with ``register_post_accumulate_grad_hook``, so whatever such a hook of the user's does to the gradient (clip
or rescale it in place, registered before or after wrapping) is in the gradient the reducer reads and
averages. A tensor hook of ours would run before the user's hooks registered later and read the gradient
before they change it: the average would silently differ from torch's DDP's. The reducer therefore hooks the
accumulators, and holds them, because a parameter holds its accumulator only weakly: one nobody holds is
made anew at every backward, without the hook.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from lightning_ddpx._compat.torch import will_engine_execute_node

__all__ = ["AccumulatorHooks", "PostHook", "gradient_accumulator"]


def gradient_accumulator(param: torch.Tensor) -> torch.autograd.graph.Node:
    """The ``AccumulateGrad`` node that writes ``param.grad`` (the one every backward uses while it is held)."""
    with torch.enable_grad():  # a view's grad_fn links to the accumulator only with grad mode on
        node = param.view_as(param).grad_fn
    if node is None or not node.next_functions or node.next_functions[0][0] is None:
        raise ValueError(
            "lightning_ddpx: a gradient accumulator exists only for a leaf with requires_grad=True"
        )
    return node.next_functions[0][0]


# A node post-hook: called with the node's outputs and inputs (for an accumulator: none, and the gradient).
PostHook = Callable[[Any, Any], None]


# The latest hooks put on each parameter: a module wrapped again while its old wrapper lives (not closed)
# carries both wrappers' hooks, and the old one's must let the new one's gradients pass.
# Keyed by id(param): the hooks hold their parameters, so an id is not reused while its entry can be read.
_LATEST: dict[int, weakref.ref[AccumulatorHooks]] = {}


def _forget(key: int, ref: weakref.ref[AccumulatorHooks]) -> None:
    if _LATEST.get(key) is ref:
        del _LATEST[key]


class AccumulatorHooks:
    """``make_hook(i)`` runs after each backward's accumulation into ``params[i].grad`` (and after the
    parameter's own post-accumulate-grad hooks); :meth:`remove` takes the hooks off and lets go of the
    accumulators."""

    def __init__(self, params: Sequence[torch.Tensor], make_hook: Callable[[int], PostHook]) -> None:
        self._params = list(params)
        self._accumulators = [gradient_accumulator(p) for p in params]
        self._handles = [node.register_hook(make_hook(i)) for i, node in enumerate(self._accumulators)]
        for param in self._params:
            key = id(param)
            _LATEST[key] = weakref.ref(self, lambda ref, key=key: _forget(key, ref))

    def latest(self, index: int) -> bool:
        """Whether these are the latest hooks put on ``params[index]`` (no newer wrapper hooked it since)."""
        ref = _LATEST.get(id(self._params[index]))
        return ref is not None and ref() is self

    def any_will_run(self) -> bool:
        """During a backward: whether it accumulates into any of the parameters (``loss.backward()`` does;
        ``torch.autograd.grad`` of the inputs, as a gradient penalty computes, does not)."""
        return any(will_engine_execute_node(node) for node in self._accumulators)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for index, param in enumerate(self._params):
            if self.latest(index):
                del _LATEST[id(param)]
        self._handles, self._accumulators, self._params = [], [], []
