"""One parameter updated in pieces: the optimizer step for a slice of it, as soon as that slice is reduced.

The optimizer overlap (:mod:`lightning_ddpx.engine.optim.overlap`) hides each bucket's update behind the
communication of later buckets, except the last bucket's: nothing is left on the wire by then. When the last
bucket holds one large parameter (the first layer's weight, 20 % of the benchmark MLP), that exposed update
is most of what the overlap leaves. Reducing that bucket in chunks and stepping each chunk's slice of the
parameter while the next chunks travel hides all but the last slice.

Why this gives the plain step's parameters, bit for bit: the optimizers in :data:`ELEMENTWISE_OPTIMIZERS`
update each element from that element's parameter, gradient and state values and from per-parameter
scalars (the step count, learning rate, bias corrections). A slice stepped with slices of the state and
copies of those scalars computes every element as the whole update does, provided the cuts keep the
elementwise kernels' vector blocks (``bucketing.CHUNK_ALIGN_ELEMENTS``). Each slice's state tensors are
views into the parameter's state, so the update lands in the user's optimizer state; the scalars (``step``
and the like) advance once per slice on private copies and are written back once, when the last slice is
done. ``tests/engine/test_piecewise_step.py`` compares piecewise and whole updates for every optimizer listed.

A parameter qualifies only when that reasoning holds for it (:func:`steps_in_pieces`): an optimizer listed
here (Adafactor is not: its factored statistics are means over rows and columns), a contiguous parameter
and gradient, and state that already exists (the first step creates it) made of tensors shaped like the
parameter and zero-dimensional tensors or plain numbers.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Callable

import torch

from lightning_ddpx._compat.torch import without_step_hooks

__all__ = ["ELEMENTWISE_OPTIMIZERS", "PiecewiseStep", "optimizer_view", "steps_in_pieces"]

ELEMENTWISE_OPTIMIZERS = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "Adadelta",
    "Adagrad",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
)


def optimizer_view(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class sharing its state and options, without hooks or step wrappers:
    setting its ``param_groups`` (or ``state``) and calling ``step()`` runs the class's own update on just
    those parameters, while the user's optimizer is left as it is."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)  # state (shared), defaults, flags the class's step reads
    view.__dict__.pop("step", None)  # an LR scheduler's wrapper of the user's bound step
    without_step_hooks(view)
    return view


@functools.lru_cache(maxsize=1)
def _elementwise_classes() -> tuple[type, ...]:
    return tuple(getattr(torch.optim, name) for name in ELEMENTWISE_OPTIMIZERS if hasattr(torch.optim, name))


def steps_in_pieces(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether ``param``'s update by ``optimizer`` can be split into slices (see the module docstring)."""
    base = next((klass for klass in type(optimizer).__mro__ if "step" in vars(klass)), None)
    if base not in _elementwise_classes():
        return False
    grad = param.grad
    if grad is None or grad.layout != torch.strided:  # a sparse gradient steps whole
        return False
    if not param.is_contiguous() or not grad.is_contiguous() or grad.shape != param.shape:
        return False
    state = optimizer.state.get(param)
    if not state:
        return False
    return all(
        (value.shape == param.shape and value.is_contiguous()) or value.dim() == 0
        if isinstance(value, torch.Tensor)
        else isinstance(value, (int, float))
        for value in state.values()
    )


class PiecewiseStep:
    """The update of one parameter in one optimizer step, applied slice by slice.

    ``make_view()`` returns an optimizer of the user's class sharing its options (the overlap's view);
    ``group`` is the parameter's param group. Call :meth:`step` for each slice, in any order, each slice
    once, then :meth:`finish` once.
    """

    def __init__(
        self,
        make_view: Callable[[], torch.optim.Optimizer],
        group: dict[str, Any],
        param: torch.Tensor,
        state: dict[str, Any],
    ) -> None:
        self._make_view = make_view
        self._group = group
        self._param = param
        self._state = state
        self._flat_param = param.detach().view(-1)
        self._flat_grad = param.grad.view(-1)  # type: ignore[union-attr]
        self._sliced = [key for key, value in state.items() if _sliced(value, param)]
        self._last_piece_state: dict[str, Any] | None = None

    def step(self, start: int, end: int) -> None:
        """Update elements ``[start, end)`` of the flattened parameter."""
        piece = self._flat_param[start:end]
        piece.grad = self._flat_grad[start:end]
        views = {key: self._state[key].view(-1)[start:end] for key in self._sliced}
        piece_state = {
            key: views[key] if key in views else (value.clone() if isinstance(value, torch.Tensor) else value)
            for key, value in self._state.items()
        }
        view = self._make_view()
        view.state = defaultdict(dict, {piece: piece_state})
        view.param_groups = [{**self._group, "params": [piece]}]
        view.step()
        for key, value in views.items():
            if piece_state[key] is not value:  # the class replaced the tensor instead of updating it in place
                value.copy_(piece_state[key])
        self._last_piece_state = piece_state

    def finish(self) -> None:
        """Write back the per-parameter scalars (every slice advanced its own copy the same way)."""
        done = self._last_piece_state
        if done is None:
            return
        for key, value in self._state.items():
            if key in self._sliced:
                continue
            if isinstance(value, torch.Tensor):
                value.copy_(done[key])
            else:
                self._state[key] = done[key]


def _sliced(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape
