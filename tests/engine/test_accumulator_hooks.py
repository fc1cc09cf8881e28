"""Gradient readiness from the parameters' gradient accumulators (engine/reducer/accumulator_hooks.py), in one
process: after the parameter's own post-accumulate-grad hooks, at every backward, until removed."""

from __future__ import annotations

import pytest
import torch

from lightning_ddpx.engine.reducer.accumulator_hooks import AccumulatorHooks, gradient_accumulator


def test_runs_after_the_parameters_own_hooks_at_every_backward_until_removed() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    seen: list[tuple[int, float]] = []

    def make_hook(i: int):  # noqa: ANN202 - a node post-hook
        return lambda _outputs, _inputs: seen.append((i, float(params[i].grad.sum())))

    hooks = AccumulatorHooks(params, make_hook)

    def times_ten(param: torch.Tensor) -> None:
        param.grad.mul_(10)

    params[0].register_post_accumulate_grad_hook(times_ten)  # registered after ours
    for _ in range(2):  # the accumulators are held, so the hooks survive between backwards
        for p in params:
            p.grad = None
        (params[0].sum() + 2 * params[1].sum()).backward()
    assert sorted(seen) == [(0, 30.0), (0, 30.0), (1, 4.0), (1, 4.0)]  # the user's x10 already applied
    hooks.remove()
    seen.clear()
    params[0].sum().backward()
    assert seen == []


def test_a_parameter_without_gradients_has_no_accumulator() -> None:
    with pytest.raises(ValueError, match="requires_grad=True"):
        gradient_accumulator(torch.ones(2))
    with torch.no_grad():  # built with grad mode off too (e.g. wrapping inside torch.no_grad())
        assert gradient_accumulator(torch.nn.Parameter(torch.ones(2))) is not None


def test_any_will_run_tells_a_backward_from_autograd_grad_of_the_inputs() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    hooks = AccumulatorHooks([weight], lambda i: lambda _outputs, _inputs: None)
    x = torch.ones(3, requires_grad=True)
    seen: list[bool] = []
    out = (x * weight).sum()
    out.grad_fn.register_prehook(lambda grad_outputs: seen.append(hooks.any_will_run()))
    torch.autograd.grad(out, x, retain_graph=True)  # a gradient penalty's: weight.grad stays untouched
    out.backward()
    assert seen == [False, True]
    hooks.remove()
