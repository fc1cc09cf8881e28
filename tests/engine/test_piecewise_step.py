"""A parameter updated slice by slice (``engine.piecewise_step``) gets exactly the whole update.

Each optimizer that ``steps_in_pieces`` accepts is stepped on two copies of one parameter: whole, and in
the slices the overlap would use for it (``bucketing.chunk_ranges``), for several steps after a first,
whole, step that creates the state. Parameters and every state entry must be bit-identical.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

from lightning_ddpx.engine.buckets.plan import chunk_ranges
from lightning_ddpx.engine.optim.piecewise_step import (
    ELEMENTWISE_OPTIMIZERS,
    PiecewiseStep,
    optimizer_view,
    steps_in_pieces,
)

OPTIONS: dict[str, dict[str, Any]] = {
    "SGD": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True},
    "Adam": {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01},
    "AdamW": {"lr": 1e-2, "weight_decay": 0.1},
    "RMSprop": {"lr": 1e-2, "momentum": 0.9, "centered": True},
    "NAdam": {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1},
    "RAdam": {"lr": 1e-2},
    "ASGD": {"lr": 1e-2, "t0": 1.0},
    "Rprop": {"lr": 1e-2},
    "Adagrad": {"lr": 1e-2, "lr_decay": 0.01},
    "Adadelta": {"lr": 1.0},
    "Adamax": {"lr": 1e-2},
}


# the same classes through their other implementations (name: class, options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "AdamW_fused": ("AdamW", {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "Adam_foreach": ("Adam", {"lr": 1e-2, "foreach": True}),
    "SGD_foreach": ("SGD", {"lr": 0.1, "momentum": 0.9, "foreach": True}),
}
CASES = {**{name: (name, options) for name, options in OPTIONS.items()}, **VARIANTS}


def test_every_elementwise_optimizer_has_options_here() -> None:
    assert sorted(OPTIONS) == sorted(ELEMENTWISE_OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("shape", [(300, 70), (5000,)], ids=["matrix_with_tail", "vector"])
def test_slices_give_the_whole_update_bit_for_bit(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(shape))
    sliced = copy.deepcopy(whole)
    cls, options = CASES[name]
    make = getattr(torch.optim, cls)
    opt_whole, opt_sliced = make([whole], **options), make([sliced], **options)
    ranges = chunk_ranges([0], [whole.numel()], 2000)  # cuts at 2048, 4096, ...: the last slice has a tail
    assert len(ranges) >= 3
    sliced_steps = 0
    for step in range(4):
        grad = torch.randn(shape)
        whole.grad, sliced.grad = grad.clone(), grad.clone()
        opt_whole.step()
        if not steps_in_pieces(opt_sliced, sliced):  # no state yet (most classes create it in step 1)
            assert step == 0, f"{name} step {step}: the state exists, so slices must be possible"
            opt_sliced.step()
            continue
        sliced_steps += 1
        state = opt_sliced.state[sliced]
        make_view = functools.partial(optimizer_view, opt_sliced)  # what the overlap hands PiecewiseStep
        piecewise = PiecewiseStep(make_view, opt_sliced.param_groups[0], sliced, state)
        for start, end in reversed(ranges):  # any order: each slice reads only its own elements
            piecewise.step(start, end)
        piecewise.finish()
        assert torch.equal(whole, sliced), f"{name} step {step}: parameters differ"
        state_whole, state_sliced = opt_whole.state[whole], opt_sliced.state[sliced]
        assert state_whole.keys() == state_sliced.keys()
        for key, value in state_whole.items():
            other = state_sliced[key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"{name} step {step}: state {key!r} differs"
    assert sliced_steps >= 3


def test_what_does_not_qualify_for_slices() -> None:
    param = torch.nn.Parameter(torch.randn(64, 64))
    param.grad = torch.randn(64, 64)
    adafactor = torch.optim.Adafactor([param], lr=1e-2)
    adafactor.step()
    assert not steps_in_pieces(adafactor, param), "row/column statistics are not elementwise"

    class OwnStep(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    own = OwnStep([param], lr=0.1, momentum=0.9)
    own.step()
    assert not steps_in_pieces(own, param), "an overridden step() may not be elementwise"
    plain = torch.optim.SGD([param], lr=0.1)  # no momentum: no state ever, so nothing to slice
    plain.step()
    assert not steps_in_pieces(plain, param)
    momentum = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    momentum.step()
    assert steps_in_pieces(momentum, param)
    param.grad = torch.randn(64, 64).t()  # a strided gradient cannot be sliced as a flat view
    assert not steps_in_pieces(momentum, param)
