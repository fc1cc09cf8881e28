"""PowerSGD memory belongs to parameters: it survives any change of bucket layout.

The strongest check is torch's documented resume recipe on the bare module: save only the hook state,
build a fresh module (whose buckets start in declaration order and are rebuilt after one iteration),
load the state, register the hook, continue -- bit-identical to never stopping.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import lightning_ddpx
from lightning_ddpx.hooks import PowerSGDState, powersgd_hook
from lightning_ddpx.hooks.layout import TensorSlot
from lightning_ddpx.hooks.powersgd.plan import plan_powersgd
from lightning_ddpx.hooks.powersgd.remap import assemble, explode
from tests.dist_utils import run_distributed

SMALL_BUCKETS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0002}  # ~262 and ~52 floats: 4 buckets
OPTIONS = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
STEPS, STOP_AT = 12, 6


class HeadDeclaredFirst(nn.Module):
    """Declared head first, used last: gradients become ready head first, the reverse of what the
    declaration-order initial buckets expect, so a rebuilt layout differs from a fresh module's."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(24, 4)
        self.body = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh())
        self.extra = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.extra(self.body(x))))


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 12, generator=generator)
    return model(x).pow(2).mean() * (1 + rank)


def build(cap: dict, seed: int = 0) -> tuple[lightning_ddpx.DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = lightning_ddpx.DistributedDataParallel(HeadDeclaredFirst(), **cap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer


def train(model, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.step()


def through_bytes(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def straight_vs_resumed(rank: int, world_size: int, resume_cap: dict) -> dict:
    model, optimizer = build(SMALL_BUCKETS)
    state = PowerSGDState(model.process_group, **OPTIONS)
    model.register_comm_hook(state, powersgd_hook)
    train(model, optimizer, rank, range(STEPS))
    straight = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    model.close()

    model, optimizer = build(SMALL_BUCKETS)
    state = PowerSGDState(model.process_group, **OPTIONS)
    model.register_comm_hook(state, powersgd_hook)
    train(model, optimizer, rank, range(STOP_AT))
    saved = through_bytes(
        {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()}
    )
    model.close()

    fresh, fresh_optimizer = build(resume_cap, seed=1)  # other initial weights: all must come from the save
    fresh.module.load_state_dict(saved["model"])
    fresh_optimizer.load_state_dict(saved["optimizer"])
    fresh_state = PowerSGDState(fresh.process_group, **OPTIONS)
    fresh_state.load_state_dict(saved["hook"])
    fresh.register_comm_hook(fresh_state, powersgd_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(fresh, fresh_optimizer, rank, range(STOP_AT, STEPS))
    resumed = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    plans = [info.parameter_names for info in fresh.bucket_plan()]
    fresh.close()
    return {
        "diff": max((straight[n] - resumed[n]).abs().max().item() for n in straight),
        "warnings": [str(w.message) for w in caught if "PowerSGD" in str(w.message)],
        "pools": (len(fresh_state.shared.q_pool), len(fresh_state.per_rank.error_pool)),
        "buckets": len(plans),
        "saved_buckets": len(saved["hook"]["shared"]["layout"]),
    }


@pytest.mark.slow
@pytest.mark.processes
def test_torch_resume_recipe_continues_bit_identically() -> None:
    for rank, result in enumerate(run_distributed(straight_vs_resumed, 2, SMALL_BUCKETS, timeout=180)):
        assert result["buckets"] > 2 and result["saved_buckets"] > 2, result
        assert result["warnings"] == [], result
        assert result["pools"] == (0, 0), result  # every piece found its new bucket
        assert result["diff"] == 0.0, f"rank {rank}: resumed run differs by {result['diff']:.3g}"


@pytest.mark.slow
@pytest.mark.processes
def test_a_changed_bucket_cap_keeps_the_memory() -> None:
    """Resuming with one big bucket instead of several: the memory moves into it (no reset warning, nothing
    left over) and training continues exactly, because PowerSGD's arithmetic is per matrix."""
    one_bucket = {"bucket_cap_mb": 25.0, "first_bucket_cap_mb": 25.0}
    for rank, result in enumerate(run_distributed(straight_vs_resumed, 2, one_bucket, timeout=180)):
        assert result["buckets"] == 1, result
        assert result["warnings"] == [] and result["pools"] == (0, 0), result
        assert result["diff"] == 0.0, f"rank {rank}: resumed run differs by {result['diff']:.3g}"


# ------------------------------------------------------------------------------------------- pure
def test_explode_then_assemble_into_another_layout_moves_every_piece() -> None:
    shapes = [(6, 5), (5,), (4, 6), (6, 5)]
    names = ["a", "b", "c", "d"]
    slots, offset = [], 0
    for shape in shapes:
        slots.append(TensorSlot(offset, shape))
        offset += torch.Size(shape).numel()
    old = plan_powersgd(offset, slots, 2, 1.0, False)
    q, error = torch.randn(old.q_numel), torch.randn(old.packed_numel)
    q_pool, error_pool = explode(old, names, q, error)
    assert sorted(q_pool) == sorted(error_pool) == ["a", "c", "d"]  # b, a bias, is not compressed

    order = [3, 1, 0, 2]  # the same parameters in another bucket order
    new_slots, offset = [], 0
    for i in order:
        new_slots.append(TensorSlot(offset, shapes[i]))
        offset += torch.Size(shapes[i]).numel()
    new = plan_powersgd(offset, new_slots, 2, 1.0, False)
    new_names = [names[i] for i in order]
    new_q, new_error = torch.zeros(new.q_numel), torch.zeros(new.packed_numel)
    assert assemble(new, new_names, q_pool, new_q, "q") and not q_pool
    assert assemble(new, new_names, error_pool, new_error, "error") and not error_pool
    # back again: the original packing is reproduced exactly
    q_back, error_back = explode(new, new_names, new_q, new_error)
    again_q, again_error = torch.zeros_like(q), torch.zeros_like(error)
    assert assemble(old, names, q_back, again_q, "q") and assemble(
        old, names, error_back, again_error, "error"
    )
    assert torch.equal(again_q, q) and torch.equal(again_error, error)


def test_pieces_of_another_shape_are_not_applied() -> None:
    plan = plan_powersgd(30, [TensorSlot(0, (6, 5))], 2, 1.0, False)
    out = torch.zeros(plan.q_numel)
    assert not assemble(plan, ["a"], {"a": torch.ones(4, 2)}, out, "q")
    assert torch.equal(out, torch.zeros(plan.q_numel))
