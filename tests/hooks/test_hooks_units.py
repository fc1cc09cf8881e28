"""Single-process tests of the hooks package: pure maths, packing plans, options, registry, markers, and
PowerSGD invariants on a one-rank gloo group (created in this process, no spawn)."""

from __future__ import annotations

import io
import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_ddpx import GradBucket
from lightning_ddpx.engine.buckets.grad_bucket import issues_collectives_on_call
from lightning_ddpx.hooks import (
    PowerSGDOptions,
    PowerSGDState,
    allreduce_hook,
    available_hooks,
    batched_powersgd_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    build_comm_hook,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
    powersgd_hook,
    register_hook_name,
)
from lightning_ddpx.hooks.layout import TensorSlot, bucket_layout, segment_sizes
from lightning_ddpx.hooks.powersgd.lowrank import matrix_shape, orthogonalize_, should_compress, square_side
from lightning_ddpx.hooks.powersgd.plan import plan_powersgd


# ------------------------------------------------------------------------------------------ lowrank
def test_matrix_shape_flattens_trailing_dimensions() -> None:
    assert matrix_shape((8, 3, 3, 3)) == (8, 27)
    assert matrix_shape((16,)) == (16, 1)
    assert matrix_shape(()) == (1, 1)
    assert matrix_shape((0, 5)) == (0, 0)


def test_should_compress_is_torchs_rule() -> None:
    assert should_compress(64, 64, 1, 2)  # 128 * 2 < 4096
    assert not should_compress(64, 1, 1, 2)  # a bias: never worth it
    assert not should_compress(8, 8, 4, 1)  # (8 + 8) * 4 == 64: not strictly smaller
    assert should_compress(8, 8, 3, 1)
    assert should_compress(16, 1, 1, 0.5)  # a rate below 1 compresses even vectors


def test_square_side() -> None:
    assert [square_side(n) for n in (1, 2, 4, 5, 9, 10, 1_000_000)] == [1, 2, 2, 3, 3, 4, 1000]


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns_spanning_the_input(rank: int) -> None:
    generator = torch.Generator().manual_seed(rank)
    matrices = torch.randn(3, 20, rank, generator=generator, dtype=torch.float64)
    original = matrices.clone()
    orthogonalize_(matrices)
    eye = torch.eye(rank, dtype=torch.float64).expand(3, rank, rank)
    torch.testing.assert_close(matrices.transpose(1, 2) @ matrices, eye)
    # Same column space: projecting the input onto the new basis changes nothing.
    torch.testing.assert_close(matrices @ (matrices.transpose(1, 2) @ original), original)


def test_orthogonalize_half_precision_uses_gram_schmidt() -> None:
    matrices = torch.randn(2, 16, 4).to(torch.bfloat16)
    orthogonalize_(matrices)  # QR has no bf16 kernel: must not raise
    gram = (matrices.transpose(1, 2) @ matrices).float()
    torch.testing.assert_close(gram, torch.eye(4).expand(2, 4, 4), atol=5e-2, rtol=0)


def test_orthogonalize_zero_column_stays_zero_and_epsilon_applies() -> None:
    zero = torch.zeros(1, 5, 1)
    orthogonalize_(zero)
    assert torch.equal(zero, torch.zeros(1, 5, 1)), "an all-zero gradient must not turn into NaN"
    column = torch.full((1, 4, 1), 0.5)  # norm 1
    orthogonalize_(column, epsilon=1.0)
    torch.testing.assert_close(column, torch.full((1, 4, 1), 0.25))


def test_orthogonalize_rejects_wide_matrices() -> None:
    with pytest.raises(ValueError, match="effective_rank"):
        orthogonalize_(torch.randn(1, 2, 3))


# ------------------------------------------------------------------------------------------- layout
def test_plan_compresses_only_matrices_that_pass_and_groups_by_shape() -> None:
    slots = [
        TensorSlot(0, (32, 16)),  # compressed, group A
        TensorSlot(512, (32,)),  # bias: uncompressed
        TensorSlot(544, (8, 2, 3, 3)),  # conv (8, 18): compressed, group B
        TensorSlot(688, (32, 16)),  # group A again
        TensorSlot(1200, (3, 3)),  # (3 + 3) * 1 * 2 = 12 >= 9: uncompressed
    ]
    plan = plan_powersgd(1209, slots, rank=1, min_compression_rate=2, batch_random_draws=False)
    assert plan.uncompressed == (1, 4)
    assert [(g.rows, g.cols, g.members) for g in plan.groups] == [(32, 16, (0, 3)), (8, 18, (2,))]
    assert plan.compressed == (0, 3, 2)
    assert plan.packed_numel == 2 * 512 + 144
    assert (plan.p_numel, plan.q_numel) == (2 * 32 + 8, 2 * 16 + 18)
    assert plan.uncompressed_numel == 32 + 9
    assert plan.q_draw_sizes == (16, 16, 18)
    assert plan.numel_before == 2 * 512 + 32 + 144 + 9
    assert plan.numel_after == 2 * 48 + 32 + 26 + 9
    batched = plan_powersgd(1209, slots, rank=1, min_compression_rate=2, batch_random_draws=True)
    assert batched.q_draw_sizes == (32, 18)


def test_plan_caps_rank_per_matrix() -> None:
    plan = plan_powersgd(
        300, [TensorSlot(0, (3, 100))], rank=8, min_compression_rate=0.5, batch_random_draws=False
    )
    assert plan.groups[0].rank == 3 and plan.q_numel == 300


def test_bucket_layout_reads_offsets_with_gaps_and_segments_cover_the_buffer() -> None:
    buffer = torch.zeros(20)
    grads = [buffer[2:8].view(2, 3), buffer[10:14].view(4), buffer[14:16].view(2)]
    bucket = GradBucket(0, buffer, grads, [torch.nn.Parameter(g.clone()) for g in grads], True)
    slots = bucket_layout(bucket)
    assert slots == (TensorSlot(2, (2, 3)), TensorSlot(10, (4,)), TensorSlot(14, (2,)))
    sizes, where = segment_sizes(20, slots)
    assert sum(sizes) == 20
    pieces = buffer.split(sizes)
    for slot, w in zip(slots, where):
        assert pieces[w].data_ptr() == buffer[slot.offset :].data_ptr() and pieces[w].numel() == slot.numel


# ------------------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"start_powerSGD_iter": 1}, r"start_powerSGD_iter=1.*rebuilt after iteration 1.*>= 2"),
        ({"start_powerSGD_iter": 0, "use_error_feedback": False}, r"warm_start=True"),
        ({"matrix_approximation_rank": 0}, r"matrix_approximation_rank must be >= 1"),
        ({"min_compression_rate": 0}, r"min_compression_rate must be > 0"),
        ({"min_compression_rate": -1.5}, r"min_compression_rate"),
        ({"orthogonalization_epsilon": -1e-8}, r"orthogonalization_epsilon must be >= 0"),
        ({"random_seed": -1}, r"random_seed must be in \[0, 2\*\*32\)"),
        ({"compression_stats_logging_frequency": -1}, r"compression_stats_logging_frequency"),
        ({"start_powerSGD_iter": -3, "use_error_feedback": False, "warm_start": False}, r"must be >= 0"),
    ],
)
def test_options_are_validated_with_the_option_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PowerSGDOptions(**kwargs)
    with pytest.raises(ValueError, match=match):  # the torch-style constructor validates the same way
        PowerSGDState(None, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"matrix_approximation_rank": 1.5}, "matrix_approximation_rank must be an integer"),
        ({"warm_start": 1}, "warm_start must be True or False"),
        ({"min_compression_rate": float("nan")}, "min_compression_rate must be a finite number"),
        (
            {"min_compression_rate": 10**400},
            "min_compression_rate must be a finite number",
        ),  # no float holds it
        ({"orthogonalization_epsilon": float("inf")}, "orthogonalization_epsilon must be a finite number"),
        ({"start_powerSGD_iter": True}, "start_powerSGD_iter must be an integer"),
    ],
)
def test_options_reject_wrong_types(kwargs: dict, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        PowerSGDOptions(**kwargs)


def test_options_defaults_are_torchs_and_start_below_two_is_fine_without_memory() -> None:
    import inspect

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState as TorchState

    theirs = {
        n: p.default for n, p in inspect.signature(TorchState).parameters.items() if n != "process_group"
    }
    ours = {
        n: p.default for n, p in inspect.signature(PowerSGDState).parameters.items() if n != "process_group"
    }
    assert list(ours.items()) == list(theirs.items())
    assert PowerSGDOptions() == PowerSGDOptions(**theirs)
    state = PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)
    assert state.compressing()


def test_options_from_dict_names_unknown_keys_and_process_group() -> None:
    assert PowerSGDOptions.from_dict({"matrix_approximation_rank": 2}).matrix_approximation_rank == 2
    with pytest.raises(ValueError, match=r"unknown PowerSGD option\(s\) \['rank'\]; valid options are \["):
        PowerSGDOptions.from_dict({"rank": 2})
    with pytest.raises(ValueError, match="pass it separately"):
        PowerSGDOptions.from_dict({"process_group": None})


# ----------------------------------------------------------------------------------------- registry
def test_available_hooks_and_build() -> None:
    assert {"allreduce", "fp16", "bf16", "powersgd", "batched_powersgd", "noop"} <= set(available_hooks())
    state, hook = build_comm_hook("allreduce")
    assert state is None and hook is allreduce_hook
    state, hook = build_comm_hook(
        "powersgd", powersgd={"matrix_approximation_rank": 2, "start_powerSGD_iter": 5}
    )
    assert isinstance(state, PowerSGDState) and hook is powersgd_hook
    assert state.options.matrix_approximation_rank == 2 and state.options.start_powerSGD_iter == 5
    state, hook = build_comm_hook("batched_powersgd", powersgd=PowerSGDOptions(start_powerSGD_iter=3))
    assert hook is batched_powersgd_hook and state.options.start_powerSGD_iter == 3
    state, hook = build_comm_hook("powersgd", wrapper="fp16")
    assert state.options == PowerSGDOptions() and "powersgd_hook" in hook.__name__


def test_unknown_names_and_wrappers_list_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown communication hook 'powerSGD'; valid names are \[.*'powersgd'"
    ):
        build_comm_hook("powerSGD")
    with pytest.raises(
        ValueError, match=r"unknown hook wrapper 'fp8'; valid wrappers are \['bf16', 'fp16'\]"
    ):
        build_comm_hook("allreduce", wrapper="fp8")
    with pytest.raises(ValueError, match="takes no powersgd options"):
        build_comm_hook("fp16", powersgd={"matrix_approximation_rank": 2})
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        build_comm_hook("powersgd", powersgd={"start_powerSGD_iter": 1})


def test_register_hook_name() -> None:
    register_hook_name("test_units_custom", lambda process_group, options: ("my state", noop_hook))
    try:
        assert "test_units_custom" in available_hooks()
        assert build_comm_hook("test_units_custom") == ("my state", noop_hook)
        with pytest.raises(ValueError, match="already registered"):
            register_hook_name("test_units_custom", lambda process_group, options: (None, noop_hook))
        register_hook_name("test_units_custom", lambda pg, options: (pg, allreduce_hook), replace=True)
        assert build_comm_hook("test_units_custom")[1] is allreduce_hook
    finally:
        from lightning_ddpx.hooks import registry

        registry._REGISTRY.pop("test_units_custom", None)
    with pytest.raises(ValueError, match="built-in"):
        register_hook_name("powersgd", lambda pg, options: (pg, noop_hook))
    with pytest.raises(TypeError, match="must be callable"):
        register_hook_name("broken", "not a factory")


def test_markers_single_collective_hooks_and_wrappers_inherit() -> None:
    for hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook, noop_hook):
        assert issues_collectives_on_call(hook), hook
    for hook in (powersgd_hook, batched_powersgd_hook):
        assert not issues_collectives_on_call(hook), hook
    assert issues_collectives_on_call(fp16_compress_wrapper(allreduce_hook))
    assert issues_collectives_on_call(bf16_compress_wrapper(noop_hook))
    assert not issues_collectives_on_call(fp16_compress_wrapper(powersgd_hook))
    assert not issues_collectives_on_call(bf16_compress_wrapper(lambda state, bucket: None))


# ----------------------------------------------------------------------- PowerSGD on a one-rank group
@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo group of world size 1 in this process: allreduce is the identity, so invariants are exact."""
    created = not dist.is_initialized()
    previous_interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if previous_interface is None:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # no hostname lookup on bare CI hosts
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if created:
        dist.destroy_process_group()
    if previous_interface is None:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


SHAPES = [(24, 12), (24,), (6, 2, 3, 3), (24, 12), (4,), (5, 40)]


def make_buckets(seed: int, groups: list[list[tuple[int, ...]]]) -> list[GradBucket]:
    """Buckets holding rank-independent random gradients of ``groups`` shapes (one list per bucket)."""
    generator = torch.Generator().manual_seed(seed)
    buckets = []
    for index, shapes in enumerate(groups):
        numel = sum(math.prod(s) for s in shapes)
        buffer = torch.randn(numel, generator=generator)
        views, offset = [], 0
        for shape in shapes:
            views.append(buffer[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        params = [torch.nn.Parameter(torch.empty(shape)) for shape in shapes]
        buckets.append(GradBucket(index, buffer, views, params, index == len(groups) - 1))
    return buckets


def run_step(state: PowerSGDState, hook, buckets: list[GradBucket]) -> list[torch.Tensor]:
    return [hook(state, bucket).wait() for bucket in buckets]


@pytest.mark.parametrize("hook", [powersgd_hook, batched_powersgd_hook])
def test_error_feedback_compressed_plus_error_equals_input(one_rank_group, hook) -> None:
    state = PowerSGDState(None, start_powerSGD_iter=2, matrix_approximation_rank=2)
    for step in range(5):
        buckets = make_buckets(step, [SHAPES])
        inputs = buckets[0].buffer().clone()
        old_error = {i: e.clone() for i, e in state.per_rank.error.items()}
        run_step(state, hook, buckets)
        output = buckets[0].buffer()
        if step < 2:
            torch.testing.assert_close(output, inputs, rtol=0, atol=0)  # plain average of one rank
            continue
        runtime = state.runtime[0]
        error = state.per_rank.error[0]
        if hook is batched_powersgd_hook:  # the error covers the padded square; its head is the bucket's
            n = inputs.numel()
            previous = old_error[0][:n] if 0 in old_error else torch.zeros(n)
            torch.testing.assert_close(output + error[:n], inputs + previous)
            assert not torch.allclose(output, inputs)
            continue
        plan = runtime.plan
        compressed = [plan.slots[i] for i in plan.compressed]
        packed_old = old_error.get(0, torch.zeros(plan.packed_numel))
        offset = 0
        for slot in compressed:
            span = slice(slot.offset, slot.offset + slot.numel)
            e_new = error[offset : offset + slot.numel]
            e_old = packed_old[offset : offset + slot.numel]
            torch.testing.assert_close(output[span] + e_new, inputs[span] + e_old, rtol=1e-6, atol=1e-6)
            assert not torch.allclose(output[span], inputs[span]), "a compressed gradient must change"
            offset += slot.numel
        for i in plan.uncompressed:  # exact average, which on one rank is the input itself
            slot = plan.slots[i]
            span = slice(slot.offset, slot.offset + slot.numel)
            torch.testing.assert_close(output[span], inputs[span], rtol=0, atol=0)


def test_uncompressed_tensors_are_exact_and_low_rank_input_is_recovered(one_rank_group) -> None:
    # A gradient that is exactly rank 1 is reproduced exactly by rank-1 PowerSGD (no error left).
    state = PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)
    u, v = torch.randn(24, 1), torch.randn(1, 12)
    bucket = make_buckets(0, [[(24, 12), (24,)]])[0]
    bucket.gradients()[0].copy_(u @ v)
    bias = bucket.gradients()[1].clone()
    run_step(state, powersgd_hook, [bucket])
    torch.testing.assert_close(bucket.gradients()[0], u @ v, rtol=1e-5, atol=1e-5)
    assert torch.equal(bucket.gradients()[1], bias)


def test_iteration_moves_once_per_step_whatever_the_bucket_count(one_rank_group) -> None:
    for hook in (powersgd_hook, batched_powersgd_hook):
        state = PowerSGDState(None, start_powerSGD_iter=2)
        layout = [SHAPES[:2], SHAPES[2:4], SHAPES[4:]]
        for step in range(5):
            run_step(state, hook, make_buckets(step, layout))
            assert state.iter == step + 1
        stats = state.compression_stats()
        assert sorted(stats.per_bucket) == [0, 1, 2]
        per_step = [sum(c[k] for c in stats.per_bucket.values()) for k in (0, 1)]
        assert (stats.numel_before, stats.numel_after) == (3 * per_step[0], 3 * per_step[1])
        assert stats.compression_rate > 1


def test_compression_stats_report_frequency(one_rank_group) -> None:
    state = PowerSGDState(None, start_powerSGD_iter=2, compression_stats_logging_frequency=3)
    due = []
    for step in range(9):
        run_step(state, powersgd_hook, make_buckets(step, [SHAPES]))
        report = state.due_compression_stats()
        due.append(report.iteration if report else None)
    assert due == [None, None, 3, None, None, 6, None, None, 9]


@pytest.mark.parametrize("hook", [powersgd_hook, batched_powersgd_hook])
def test_state_dict_round_trip_is_bit_identical(one_rank_group, hook) -> None:
    layout = [SHAPES[:3], SHAPES[3:]]
    kwargs = dict(start_powerSGD_iter=2, matrix_approximation_rank=2, random_seed=7)
    reference = PowerSGDState(None, **kwargs)
    expected = [run_step(reference, hook, make_buckets(step, layout)) for step in range(8)]

    first = PowerSGDState(None, **kwargs)
    for step in range(4):
        run_step(first, hook, make_buckets(step, layout))
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    assert set(loaded) == {"shared", "per_rank"}
    resumed = PowerSGDState(None, **kwargs)
    resumed.load_state_dict(loaded)
    assert resumed.iter == 4
    for step in range(4, 8):
        outputs = run_step(resumed, hook, make_buckets(step, layout))
        for got, want in zip(outputs, expected[step]):
            assert torch.equal(got, want), f"step {step} differs after resuming"


def test_state_dict_warm_start_draws_continue_without_warm_start(one_rank_group) -> None:
    # Without warm start every step draws new Q from the seed generator: its state must round-trip too.
    kwargs = dict(start_powerSGD_iter=0, warm_start=False, use_error_feedback=False, random_seed=3)
    reference = PowerSGDState(None, **kwargs)
    expected = [run_step(reference, powersgd_hook, make_buckets(step, [SHAPES])) for step in range(4)]
    first = PowerSGDState(None, **kwargs)
    run_step(first, powersgd_hook, make_buckets(0, [SHAPES]))
    run_step(first, powersgd_hook, make_buckets(1, [SHAPES]))
    resumed = PowerSGDState(None, **kwargs)
    resumed.load_state_dict(first.state_dict())
    for step in (2, 3):
        assert torch.equal(
            run_step(resumed, powersgd_hook, make_buckets(step, [SHAPES]))[0], expected[step][0]
        )


def test_state_dict_with_another_rank_resets_memory_with_a_warning(one_rank_group) -> None:
    first = PowerSGDState(None, start_powerSGD_iter=2, matrix_approximation_rank=1)
    for step in range(3):
        run_step(first, powersgd_hook, make_buckets(step, [SHAPES]))
    other = PowerSGDState(None, start_powerSGD_iter=2, matrix_approximation_rank=2)
    with pytest.warns(UserWarning, match="matrix_approximation_rank=1"):
        other.load_state_dict(first.state_dict())
    assert other.iter == 3 and not other.shared.q and not other.per_rank.error
    run_step(other, powersgd_hook, make_buckets(3, [SHAPES]))  # starts afresh, does not crash
    with pytest.raises(ValueError, match="expects"):
        other.load_state_dict({"q": {}})


def test_layout_change_resets_memory_with_a_warning(one_rank_group) -> None:
    state = PowerSGDState(None, start_powerSGD_iter=2)
    for step in range(3):
        run_step(state, powersgd_hook, make_buckets(step, [SHAPES]))
    saved = state.state_dict()
    fresh = PowerSGDState(None, start_powerSGD_iter=2)
    fresh.load_state_dict(saved)
    with pytest.warns(UserWarning, match="another bucket layout"):
        run_step(fresh, powersgd_hook, make_buckets(3, [SHAPES[:3]]))
    # Same size, same number of tensors, different order (what a bucket rebuild does): also detected.
    state = PowerSGDState(None, start_powerSGD_iter=2)
    for step in range(3):
        run_step(state, powersgd_hook, make_buckets(step, [[(24, 12), (24,), (12, 24)]]))
    with pytest.warns(UserWarning, match="another bucket layout"):
        run_step(state, powersgd_hook, make_buckets(3, [[(12, 24), (24,), (24, 12)]]))


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_thin_projections_equal_plain_products(rank: int) -> None:
    """P = X Q, Q = X^T P and P Q^T, written into views of packed buffers (as the PowerSGD runtimes use
    them); rank 2 goes column by column, the others through matrix products."""
    from lightning_ddpx.hooks.powersgd.lowrank import left_project_, reconstruct_, right_project_

    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 48, generator=generator)
    q = torch.randn(48, rank, generator=generator)
    packed = torch.zeros(5 + 64 * rank)  # p lives at an offset inside a larger buffer
    p = packed[5:].view(64, rank)
    right_project_(p, x, q)
    torch.testing.assert_close(p, x @ q, rtol=1e-5, atol=1e-5)
    q_out = torch.empty(48, rank)
    left_project_(q_out, x, p)
    torch.testing.assert_close(q_out, x.t() @ p, rtol=1e-5, atol=1e-4)
    assert packed[:5].abs().sum() == 0  # nothing written outside the view
    bucket = torch.zeros(7 + 64 * 48)  # P Q^T goes into a gradient's view inside the bucket
    target = bucket[7:].view(64, 48)
    reconstruct_(target, p, q_out)
    torch.testing.assert_close(target, p @ q_out.t(), rtol=1e-5, atol=1e-3)
    assert bucket[:7].abs().sum() == 0


def test_q_draws_fill_a_2d_q_on_any_device():
    """The square (batched) runtime's Q is 2-D; off the CPU the draw is made on the CPU and copied over.
    That copy once failed with a shape error on CUDA (found on an H100); the meta device takes the same
    branch here, and on the CPU a 2-D Q gets exactly the numbers a flat one does."""
    from lightning_ddpx.hooks.powersgd.hook import _draw_q
    from lightning_ddpx.hooks.powersgd.state import PowerSGDState

    flat, square = torch.empty(244), torch.empty(122, 2)
    _draw_q(PowerSGDState(None, random_seed=3), flat, (244,))
    _draw_q(PowerSGDState(None, random_seed=3), square, (244,))
    assert torch.equal(square.view(-1), flat)
    _draw_q(PowerSGDState(None, random_seed=3), torch.empty(122, 2, device="meta"), (244,))


def test_a_registered_hook_carries_its_own_options_type() -> None:
    """A user's configurable hook registers as PowerSGD does: dict options parsed into its type, a typo or
    another hook's options refused before any communication."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class ScaleOptions:
        factor: float = 1.0

    seen = []

    def factory(process_group: Any, options: ScaleOptions | None) -> tuple[Any, Any]:
        seen.append(options)
        return process_group, allreduce_hook

    register_hook_name("test_units_scaled", factory, options_type=ScaleOptions, replace=True)
    build_comm_hook("test_units_scaled", options={"factor": 0.5})
    build_comm_hook("test_units_scaled", options=ScaleOptions(2.0))
    build_comm_hook("test_units_scaled")
    assert seen == [ScaleOptions(0.5), ScaleOptions(2.0), None]
    with pytest.raises(
        TypeError,
        match=r"unknown options option\(s\) \['factr'\] for hook 'test_units_scaled'; its options are \['factor'\]",
    ):
        build_comm_hook("test_units_scaled", options={"factr": 0.5})
    with pytest.raises(TypeError, match="options must be a ScaleOptions or a dict of its fields, got list"):
        build_comm_hook("test_units_scaled", options=[0.5])
    with pytest.raises(ValueError, match="'test_units_scaled' takes no powersgd options"):
        build_comm_hook("test_units_scaled", powersgd={"matrix_approximation_rank": 2})
    with pytest.raises(ValueError, match="'allreduce' takes no options options; drop `options=`"):
        build_comm_hook("allreduce", options={"factor": 0.5})
    with pytest.raises(ValueError, match="'test_units_scaled'"):  # the error lists who takes options=
        build_comm_hook("noop", options={"factor": 0.5})
    with pytest.raises(TypeError, match="options_type for hook 'x' must be a class"):
        register_hook_name("x", factory, options_type="ScaleOptions")  # type: ignore[arg-type]


def test_torchs_own_simple_hooks_run_inline_and_the_others_on_the_comm_thread() -> None:
    """torch's allreduce/fp16/bf16/noop hooks issue every collective before returning (read in their source):
    called inline, as our twins are. Its wrappers (closures around any hook) and PowerSGD (collectives chained
    from callbacks) keep the sequenced communication thread."""
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook

    inline = (
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
        debugging_hooks.noop_hook,
    )
    assert all(issues_collectives_on_call(hook) for hook in inline)
    sequenced = (
        powerSGD_hook.powerSGD_hook,
        powerSGD_hook.batched_powerSGD_hook,
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
        lambda state, bucket: default_hooks.allreduce_hook(state, bucket),
    )
    assert not any(issues_collectives_on_call(hook) for hook in sequenced)
