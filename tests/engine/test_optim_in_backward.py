"""torch's optimizers in backward (``_apply_optimizer_in_backward``) on our module step with the average.

Left to their own hooks they would step each rank with its local gradient and the replicas would drift
apart (0.12 after three steps on two ranks, before the module took them over). The oracle: torch's DDP
with one optimizer per parameter of the same class, stepped after backward, on the same data, which is
what torch's DDP does with optimizers in backward on CUDA (on a CPU-only build its hook needs an
accelerator and raises).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.distributed.optim.apply_optimizer_in_backward import param_to_optim_hook_handle_map

import lightning_ddpx
from tests.dist_utils import one_rank_group, run_distributed
from tests.oracle import assert_same_tensors, rank_batch

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(rank: int, world_size: int, optimizer: str, before: bool, ours_kwargs: dict) -> None:
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    base = _model()
    theirs_module, ours_module = copy.deepcopy(base), copy.deepcopy(base)
    theirs = torch.nn.parallel.DistributedDataParallel(theirs_module)
    reference = [cls([p], **kwargs) for p in theirs_module.parameters()]  # one per parameter, as in backward
    if before:
        _apply_optimizer_in_backward(cls, ours_module.parameters(), kwargs)
    ours = lightning_ddpx.DistributedDataParallel(ours_module, **ours_kwargs)
    if not before:
        _apply_optimizer_in_backward(cls, ours_module.parameters(), kwargs)
    exact = world_size == 2  # a sum scaled by 1/2 before or after is the same float; by 1/3 it is not
    for step in range(6):
        batch = rank_batch(rank, step, (8, 16))
        theirs(batch).pow(2).mean().backward()
        for opt in reference:
            opt.step()
            opt.zero_grad(set_to_none=True)
        ours(batch).pow(2).mean().backward()  # steps inside backward
        assert all(p.grad is None for p in ours_module.parameters()), "gradients left after the step"
        assert_same_tensors(
            dict(ours_module.named_parameters()), dict(theirs_module.named_parameters()),
            f"rank {rank} step {step} param", 0 if exact else 1e-6, 0 if exact else 1e-7,
        )  # fmt: skip
    flat = torch.cat([p.detach().flatten() for p in ours_module.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)  # the replicas stay identical


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("before", [True, False], ids=["applied_before_wrapping", "applied_after"])
@pytest.mark.processes
def test_optimizers_in_backward_step_with_the_average(optimizer: str, before: bool) -> None:
    run_distributed(_train, 2, optimizer, before, {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001})


@pytest.mark.processes
def test_optimizers_in_backward_on_three_ranks_with_bucket_views() -> None:
    run_distributed(_train, 3, "adam", True, {"gradient_as_bucket_view": True})


def test_optimizers_in_backward_refuse_a_comm_hook_or_the_overlap() -> None:
    with one_rank_group():
        module = _model()
        _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
        hooked = lightning_ddpx.DistributedDataParallel(module)
        hooked.register_comm_hook(None, lightning_ddpx.hooks.noop_hook)
        with pytest.raises(ValueError, match=r"'0.weight' \(and 5 more\) has optimizers in backward"):
            hooked(torch.ones(2, 16))
        assert all(
            param_to_optim_hook_handle_map[p] for p in module.parameters()
        )  # refused before any change
        hooked.close()
        overlapped = lightning_ddpx.DistributedDataParallel(module)
        overlapped.overlap_optimizer_with(torch.optim.SGD(module.parameters(), lr=0.1))
        with pytest.raises(ValueError, match="combined with overlap_optimizer_with"):
            overlapped(torch.ones(2, 16))
        overlapped.close()
        taken = lightning_ddpx.DistributedDataParallel(module)
        taken(torch.ones(2, 16))  # takes them over
        with pytest.raises(
            ValueError, match="parameters have optimizers in backward .* with register_comm_hook"
        ):
            taken.register_comm_hook(None, lightning_ddpx.hooks.noop_hook)
        with pytest.raises(
            ValueError, match="parameters have optimizers in backward .* with overlap_optimizer_with"
        ):
            taken.overlap_optimizer_with(torch.optim.SGD(module.parameters(), lr=0.1))
        taken.close()


def _no_sync_first(rank: int, world_size: int) -> None:
    """The first forward inside no_sync(): the optimizers must not step then (with the local gradient),
    and the next synchronised backward steps them once, with the average of the accumulated gradients."""
    torch.manual_seed(0)
    base = _model()
    theirs_module, ours_module = copy.deepcopy(base), copy.deepcopy(base)
    theirs = torch.nn.parallel.DistributedDataParallel(theirs_module)
    reference = [torch.optim.SGD([p], lr=0.1) for p in theirs_module.parameters()]
    _apply_optimizer_in_backward(torch.optim.SGD, ours_module.parameters(), {"lr": 0.1})
    ours = lightning_ddpx.DistributedDataParallel(ours_module)
    for model in (theirs, ours):
        with model.no_sync():
            model(rank_batch(rank, 0, (8, 16))).pow(2).mean().backward()
        model(rank_batch(rank, 1, (8, 16))).pow(2).mean().backward()
    for opt in reference:
        opt.step()
    assert_same_tensors(
        dict(ours_module.named_parameters()), dict(theirs_module.named_parameters()), f"rank {rank}", 0, 0
    )


@pytest.mark.processes
def test_a_no_sync_backward_first_does_not_step_them() -> None:
    run_distributed(_no_sync_first, 2)
