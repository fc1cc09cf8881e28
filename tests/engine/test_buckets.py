"""Bucket storage without a process group (lightning_ddpx.engine.buckets.storage): filling, single copies, views,
write-back and the plan's bookkeeping, each against the plain tensor arithmetic it stands for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ddpx.engine.buckets.plan import plan_buckets
from lightning_ddpx.engine.buckets.storage import Bucket, BucketLayout

SHAPES = [(4, 3), (3,), (5, 2), (2,), (7,)]


def params_with_grads(seed: int = 0, missing: tuple[int, ...] = ()) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    for i, p in enumerate(params):
        p.grad = None if i in missing else torch.randn(p.shape)
    return params


def one_bucket(params: list[nn.Parameter]) -> Bucket:
    numels = [p.numel() for p in params]
    (spec,) = plan_buckets(
        numels,
        [p.dtype for p in params],
        [p.device for p in params],
        list(range(len(params))),
        1 << 20,
        1 << 20,
    )
    return Bucket(spec, params, [f"p{i}" for i in range(len(params))])


def expected_flat(params: list[nn.Parameter], bucket: Bucket, scale: float | None) -> torch.Tensor:
    parts = []
    for index in bucket.spec.param_indices:
        grad = params[index].grad
        grad = torch.zeros_like(params[index]) if grad is None else grad
        parts.append((grad if scale is None else grad * scale).reshape(-1))
    return torch.cat(parts)


@pytest.mark.parametrize("scale", [None, 0.5])
@pytest.mark.parametrize("fused", [False, True])
def test_fill_lays_out_the_scaled_gradients(scale: float | None, fused: bool) -> None:
    params = params_with_grads()
    bucket = one_bucket(params)
    bucket.fused_scale = fused
    bucket.fill(scale, all_used=True)
    assert torch.equal(bucket.buffer, expected_flat(params, bucket, scale))


def test_fill_zeroes_parameters_without_gradient() -> None:
    params = params_with_grads(missing=(1, 3))
    bucket = one_bucket(params)
    bucket.buffer.fill_(7.0)  # stale values from an earlier step must not survive
    bucket.fill(0.25, all_used=False)
    assert torch.equal(bucket.buffer, expected_flat(params, bucket, 0.25))


def test_fill_into_a_target_leaves_the_buffer_alone() -> None:
    params = params_with_grads()
    bucket = one_bucket(params)
    flat = torch.zeros_like(bucket.buffer)
    views = [
        flat[o : o + params[i].numel()].view_as(params[i])
        for o, i in zip(bucket.spec.offsets, bucket.spec.param_indices)
    ]
    bucket.fill(0.5, all_used=True, target=(flat, views))
    assert torch.equal(flat, expected_flat(params, bucket, 0.5))
    assert not bucket.buffer.any()


def test_write_back_all_used_copies_every_gradient() -> None:
    params = params_with_grads()
    bucket = one_bucket(params)
    result = torch.arange(bucket.buffer.numel(), dtype=torch.float32)
    bucket.write_back(result, None, all_used=True, as_view=False)
    for offset, index in zip(bucket.spec.offsets, bucket.spec.param_indices):
        p = params[index]
        assert torch.equal(p.grad, result[offset : offset + p.numel()].view_as(p))


def test_write_back_keeps_the_grad_of_parameters_no_rank_used() -> None:
    params = params_with_grads(missing=(1,))
    kept = params[3].grad.clone()
    bucket = one_bucket(params)
    result = torch.ones(bucket.buffer.numel())
    used_counts = [1, 1, 1, 0, 1]  # parameter 3 unused on every rank; 1 used elsewhere (no grad here)
    bucket.write_back(result, used_counts, all_used=False, as_view=False)
    assert torch.equal(params[3].grad, kept)
    assert torch.equal(params[1].grad, torch.ones(SHAPES[1]))  # created from the result
    assert torch.equal(params[0].grad, torch.ones(SHAPES[0]))


def test_adopting_views_makes_grads_alias_the_buffer() -> None:
    params = params_with_grads()
    values = [p.grad.clone() for p in params]
    bucket = one_bucket(params)
    bucket.adopt_grads_as_views(None)
    for position, index in enumerate(bucket.spec.param_indices):
        assert params[index].grad is bucket.views[position]
        assert torch.equal(params[index].grad, values[index])


def test_detached_unused_view_keeps_its_value_privately() -> None:
    params = params_with_grads()
    bucket = one_bucket(params)
    bucket.adopt_grads_as_views(None)
    grad = params[bucket.spec.param_indices[2]].grad
    bucket.detach_unused_view(2)
    private = params[bucket.spec.param_indices[2]].grad
    assert private is not bucket.views[2] and torch.equal(private, grad)


def test_a_sparse_gradient_in_a_dense_bucket_is_named() -> None:
    params = params_with_grads()
    params[2].grad = torch.zeros(SHAPES[2]).to_sparse()
    bucket = one_bucket(params)
    with pytest.raises(RuntimeError, match=r"parameter\(s\) \['p2'\] received sparse gradients"):
        bucket.fill(None, all_used=True)


def test_layout_knows_each_parameter_s_bucket_and_position() -> None:
    params = params_with_grads()
    order = [4, 3, 2, 1, 0]
    specs = plan_buckets(
        [p.numel() for p in params], [p.dtype for p in params], [p.device for p in params], order, 40, 40
    )
    layout = BucketLayout(specs, params, [f"p{i}" for i in range(len(params))])
    assert layout.parameter_order() == order
    assert len(layout.buckets) > 1
    for index in range(len(params)):
        bucket = layout.buckets[layout.bucket_of[index]]
        assert bucket.params[layout.position_of[index]] is params[index]
    assert [info.parameter_names for info in layout.infos()] == [b.names for b in layout.buckets]


@pytest.mark.parametrize("scale", [None, 0.5])
def test_a_grad_set_to_none_after_accumulation_contributes_zero_and_gets_the_average(
    scale: float | None,
) -> None:
    """A hook of the user's may set ``grad`` to ``None`` after the gradient was marked ready (an optimizer
    stepping in backward does): torch's reducer contributes zero for it and gives it a copy of the result."""
    params = params_with_grads(missing=(2,))
    bucket = one_bucket(params)
    bucket.fill(scale, all_used=True)  # all_used: every gradient was marked ready in this backward
    torch.testing.assert_close(bucket.buffer, expected_flat(params, bucket, scale), rtol=0, atol=0)
    result = torch.arange(bucket.buffer.numel(), dtype=bucket.buffer.dtype)
    bucket.write_back(result, None, all_used=True, as_view=False)
    for param, view in zip(bucket.params, param_views_of(bucket, result)):
        torch.testing.assert_close(param.grad, view, rtol=0, atol=0)
    assert params[2].grad is not None and params[2].grad.data_ptr() != bucket.buffer.data_ptr()


def param_views_of(bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[o : o + p.numel()].view_as(p) for o, p in zip(bucket.spec.offsets, bucket.params)]
