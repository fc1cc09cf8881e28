"""Gradients that arrive after the reduction are named: a backward outside the module's forward.

After a synchronised backward, a second backward that does not go through the wrapper's forward (an auxiliary
loss through ``model.module.sub``, e.g. in Lightning's ``on_after_backward``) adds gradients on each rank
alone; torch's DDP lets the ranks step apart silently. Ours warns once per module with
:class:`lightning_ddpx.LocalGradientWarning` (``lightning_ddpx.engine.reducer.late_gradients``), and stays
silent where local gradients are asked for (``no_sync()``, a forward with grad sync off, before any forward,
``torch.autograd.grad``, ``backward(inputs=...)``, a filter on the category) and on every normal loop.

The rank processes ignore warnings by default (``PYTHONWARNINGS=ignore``, tests/dist_utils.py), so each case
records them with ``simplefilter("always")``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from lightning_ddpx import LocalGradientWarning
from tests.dist_utils import run_distributed
from tests.oracle import rank_batch

pytestmark = [pytest.mark.slow, pytest.mark.processes]


class Net(nn.Module):
    """``sub`` feeds ``head``; ``spare`` is used only when ``use_spare`` (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sub = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.spare = nn.Linear(8, 4)
        self.use_spare = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.sub(x))
        return self.head(hidden) + (self.spare(hidden) if self.use_spare else 0)


def batch(step: int) -> torch.Tensor:
    return rank_batch(dist.get_rank(), step, (6, 8))


def local_gradient_warnings(fn: Callable[[], Any]) -> list[str]:
    """The LocalGradientWarning messages ``fn`` emits (every warning shown: a rank ignores them by default)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, LocalGradientWarning)]


def train(model: Any, optimizer: torch.optim.Optimizer, steps: int, accumulate: int = 1) -> None:
    """The normal loop: zero_grad, (no_sync micro-batches,) forward, backward, step."""
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulate - 1):
            with model.no_sync():
                model(batch(10 * step + micro)).square().mean().backward()
        model(batch(10 * step)).square().mean().backward()
        optimizer.step()


def late_gradients(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}

    # The extra backward outside forward, after a synchronised one: named once (not again in this iteration,
    # nor in later ones), and the ranks really step apart (the warning is not a false alarm).
    model = lightning_ddpx.DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def late_then_more() -> None:
        model(batch(0)).square().mean().backward()
        model.module.sub(batch(1)).sum().backward()  # an auxiliary loss through the submodule
        model.module.sub(batch(2)).sum().backward()
        optimizer.step()
        train(model, optimizer, steps=2)
        optimizer.zero_grad()
        model(batch(3)).square().mean().backward()
        model.module.head(batch(4)).sum().backward()

    out["late"] = local_gradient_warnings(late_then_more)
    fresh = lightning_ddpx.DistributedDataParallel(Net())
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh(batch(0)).square().mean().backward()
    local_gradient_warnings(lambda: fresh.module.sub(batch(1)).sum().backward())
    opt.step()
    out["sub.weight after the step"] = fresh.module.sub.weight.detach().clone()

    # A second backward through the same outputs is still refused (before any gradient accumulates).
    twice = lightning_ddpx.DistributedDataParallel(Net())
    loss = twice(batch(0)).square().mean()
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        out["second backward"] = "no error"
    except RuntimeError as error:
        out["second backward"] = str(error)

    # Normal loops: no warning.
    normal: dict[str, list[str]] = {}
    for name, kwargs, accumulate in (
        ("plain", {}, 1),
        ("no_sync", {}, 3),
        ("find_unused_parameters", {"find_unused_parameters": True}, 2),
        ("static_graph", {"static_graph": True}, 2),
    ):
        net = Net()
        net.use_spare = name != "find_unused_parameters"
        model = lightning_ddpx.DistributedDataParallel(net, **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        normal[name] = local_gradient_warnings(functools.partial(train, model, optimizer, 3, accumulate))
    out["normal"] = normal

    # Local on purpose, or outside the window: silent.
    silent: dict[str, list[str]] = {}
    model = lightning_ddpx.DistributedDataParallel(Net())
    silent["before any forward"] = local_gradient_warnings(
        lambda: model.module.sub(batch(0)).sum().backward()
    )

    def synced() -> None:
        model(batch(1)).square().mean().backward()

    def no_sync_after_sync() -> None:
        synced()
        with model.no_sync():
            model.module.sub(batch(2)).sum().backward()

    def input_gradients() -> None:  # adversarial examples: gradients of the inputs only
        synced()
        x = batch(3).requires_grad_(True)
        (grad,) = torch.autograd.grad(model.module(x).square().mean(), x)
        x.grad = None
        model.module(x + 0.1 * grad.sign()).square().mean().backward(inputs=[x])

    def grad_sync_off() -> None:  # a forward with grad sync off closes the window: local on purpose
        synced()
        model.require_backward_grad_sync = False
        model(batch(4)).square().mean().backward()
        model.module.sub(batch(5)).sum().backward()
        model.require_backward_grad_sync = True

    def filtered() -> None:  # a fresh module: the same late backward as above, which warns unfiltered
        other = lightning_ddpx.DistributedDataParallel(Net())
        other(batch(6)).square().mean().backward()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=LocalGradientWarning)
            other.module.sub(batch(7)).sum().backward()

    for name, fn in (
        ("no_sync", no_sync_after_sync),
        ("autograd.grad, backward(inputs=...)", input_gradients),
        ("grad sync off", grad_sync_off),
        ("filtered", filtered),
    ):
        silent[name] = local_gradient_warnings(fn)
    out["silent"] = silent
    return out


def test_a_backward_outside_forward_is_named_once():
    results = run_distributed(late_gradients, 2)
    for rank, out in enumerate(results):
        late = out["late"]
        assert len(late) == 1, late
        message = late[0]
        assert message.startswith(f"lightning_ddpx (rank {rank}): parameter 'sub."), message
        for says in (
            "a backward outside the module's forward",
            "add it to the main loss",
            "through the DistributedDataParallel module's forward",
            "model.no_sync()",
            "torch.autograd.grad",
            "category=lightning_ddpx.LocalGradientWarning",
        ):
            assert says in message, (says, message)
        second = out["second backward"]
        assert second.startswith(f"lightning_ddpx (rank {rank}): a second backward"), second
        assert out["normal"] == {name: [] for name in out["normal"]}, out["normal"]
        assert out["silent"] == {name: [] for name in out["silent"]}, out["silent"]
    # what the warning is about: after the step, the replicas differ
    assert not torch.equal(results[0]["sub.weight after the step"], results[1]["sub.weight after the step"])


# ---------------------------------------------------------------------------------------- Lightning
def trainer_job(rank: int, world_size: int) -> dict[str, list[str]]:
    from tests.strategy_helpers import TinyRegressor, fit, quiet

    quiet()

    class AuxiliaryAfterBackward(TinyRegressor):
        """An auxiliary loss through the first layer, with its own backward, in on_after_backward."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.last_x = batch[0]
            return super().training_step(batch, batch_idx)

        def on_after_backward(self) -> None:
            self.net[0](self.last_x).square().mean().backward()

    out = {}
    for name, model_cls in (("plain", TinyRegressor), ("auxiliary", AuxiliaryAfterBackward)):
        out[name] = local_gradient_warnings(functools.partial(fit, "ddpx", max_steps=3, model_cls=model_cls))
    return out


def test_trainer_names_an_auxiliary_backward_in_on_after_backward():
    results = run_distributed(trainer_job, 2, init_process_group=False, timeout=240.0)
    for rank, out in enumerate(results):
        assert out["plain"] == [], out["plain"]
        assert len(out["auxiliary"]) == 1, out["auxiliary"]
        message = out["auxiliary"][0]
        assert message.startswith(f"lightning_ddpx (rank {rank}): parameter '"), message
        assert "net.0." in message and "a backward outside the module's forward" in message, message
        assert "block_backward_sync()" in message, message
