"""DiLoCo without a second rank: options and their errors, the fragment split, the strategies' refusals, the
checkpoint state (plain, ``weights_only``-loadable, round trip), and the benchmark's DiLoCo contenders and
byte counting. Also the quantized exchange's arithmetic: the same bits under the CPU's and CUDA's rules
for a division (CUDA's reproduced on the CPU by ``tests/cuda_division.py``), one test on three ranks."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_ddpx.hooks.diloco import DiLoCoOptions, DiLoCoState, fragment_of_parameters
from lightning_ddpx.hooks.outer_exchange import (
    BLOCK,
    CompletedMean,
    dequantize,
    divide,
    quantize,
    start_exchange,
)
from lightning_ddpx.lightning.settings.config import DDPXConfig
from tests.cuda_division import CudaDivisionRule, correctly_rounded_quotient
from tests.dist_utils import one_rank_group, run_distributed


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"period": 0}, ValueError, "DiLoCoOptions: period must be >= 1, got 0"),
        ({"period": 2.0}, TypeError, r"DiLoCoOptions: period must be an integer >= 1, got 2.0 \(float\)"),
        ({"overlap_steps": True}, TypeError, "overlap_steps must be an integer >= 0, got True"),
        ({"outer_lr": -1}, ValueError, "outer_lr must be a finite number >= 0"),
        ({"outer_lr": float("inf")}, ValueError, "outer_lr must be a finite number >= 0"),
        ({"outer_lr": 10**400}, ValueError, "outer_lr must be a finite number >= 0"),  # no float holds it
        ({"outer_momentum": 1.5}, ValueError, "outer_momentum must be between 0.0 and 1.0"),
        ({"outer_momentum": 0.0}, ValueError, "nesterov=True needs outer_momentum > 0"),
        ({"nesterov": "yes"}, ValueError, "nesterov must be True or False"),
        ({"period": 4, "fragments": 5}, ValueError, "fragments=5 exceeds period=4"),
        ({"period": 4, "overlap_steps": 4}, ValueError, "overlap_steps=4 must be less than period=4"),
        ({"mixing": 2}, ValueError, "mixing must be between"),
        ({"precision": "fp8"}, ValueError, "precision must be one of"),
        ({"periode": 3}, TypeError, r"unknown diloco option\(s\) \['periode'\]"),
    ],
)
def test_bad_options_name_the_option_and_the_fix(options, error, match) -> None:
    with pytest.raises(error, match=match):
        DDPXConfig(comm_hook="diloco", diloco=options)


def test_the_strategy_refuses_what_does_not_fit_diloco() -> None:
    with pytest.raises(ValueError, match="diloco options are given but comm_hook is 'powersgd'"):
        DDPXConfig(comm_hook="powersgd", diloco={"period": 3})
    with pytest.raises(ValueError, match="DiLoCo sends no gradients to compress.*'precision': 'fp16'"):
        DDPXConfig(comm_hook="diloco", comm_wrapper="fp16")
    with pytest.raises(ValueError, match="overlap_optimizer=True cannot be combined"):
        DDPXConfig(comm_hook="diloco", overlap_optimizer=True)
    with pytest.raises(TypeError, match="diloco must be a DiLoCoOptions or a dict"):
        DDPXConfig(comm_hook="diloco", diloco=[3])
    config = DDPXConfig(comm_hook="diloco")
    assert config.diloco == DiLoCoOptions() and config.hook_name == "diloco"
    assert DDPXConfig(comm_hook="diloco", diloco=DiLoCoOptions(period=7)).diloco.period == 7


def test_fragments_are_contiguous_and_balanced_by_elements() -> None:
    assert fragment_of_parameters([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert fragment_of_parameters([30, 1, 1, 8], 2) == [0, 1, 1, 1]  # 30 of 40 before the second
    assert fragment_of_parameters([1000, 1, 1], 3) == [0, 1, 2]  # one huge parameter: equal counts
    with pytest.raises(ValueError, match="fragments=3 exceeds the model's 2 trainable parameters"):
        fragment_of_parameters([4, 4], 3)
    o = DiLoCoOptions(period=10, fragments=4)
    assert [o.offset(f) for f in range(4)] == [2, 5, 7, 10]


@pytest.mark.parametrize(("bits", "row_bytes"), [(8, 2 * BLOCK + 2 * 4), (4, BLOCK + 2 * 4)])
def test_quantized_codes_round_to_the_nearest_level_of_each_blocks_scale(bits: int, row_bytes: int) -> None:
    torch.manual_seed(0)
    rows = torch.randn(3, 2 * BLOCK) * torch.tensor([[1e-3], [10.0], [0.0]])
    rows[1, BLOCK:] *= 1e-4  # a second block of much smaller values keeps its own scale
    payload = quantize(rows, bits)
    assert payload.dtype == torch.uint8 and payload.shape == (3, row_bytes)
    decoded = dequantize(payload, bits, 2 * BLOCK)
    qmax = 2 ** (bits - 1) - 1
    blocks, got = rows.view(3, 2, BLOCK), decoded.view(3, 2, BLOCK)
    half_step = blocks.abs().amax(dim=2, keepdim=True) / qmax / 2
    assert ((blocks - got).abs() <= half_step * (1 + 1e-6)).all()
    assert torch.equal(decoded[2], torch.zeros(2 * BLOCK))  # an all-zero block decodes to zeros
    extremes = blocks.abs().argmax(dim=2, keepdim=True)  # each block's largest value is exact
    torch.testing.assert_close(got.gather(2, extremes), blocks.gather(2, extremes), rtol=1e-6, atol=0)


def test_an_unattached_state_says_how_to_attach_it() -> None:
    with pytest.raises(RuntimeError, match=r"DiLoCoState.attach\(module.parameters\(\)\)"):
        DiLoCoState(DiLoCoOptions(period=2)).averager.average_parameters([])


def _step(model: nn.Module, state: DiLoCoState, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    state.averager.average_parameters(optimizer.param_groups)


ROUND_TRIP_OPTIONS = {"period": 4, "fragments": 2, "overlap_steps": 1, "precision": "fp16"}


def _run(steps: int, saved: bytes | None = None, save_at: int | None = None, options: dict | None = None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    state = DiLoCoState(DiLoCoOptions(**(options or ROUND_TRIP_OPTIONS)))
    state.attach(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    first = 0
    if saved is not None:
        checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        state.load_state_dict(checkpoint["diloco"])
        first = state.step
    out = None
    for step in range(first, steps):
        _step(model, state, optimizer, step)
        if save_at == step + 1:
            buffer = io.BytesIO()
            sd = state.state_dict()
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "diloco": sd}, buffer
            )
            out = buffer.getvalue()
    return model, state, out


@pytest.mark.parametrize(
    ("precision", "overlap", "save_at", "dtype"),
    [
        ("fp16", 1, 6, torch.float16),  # fragment 1 sent at 4 applied at 5; fragment 0 sent at 6: in flight
        ("int4", 2, 6, torch.float32),  # fragment 0 sent at 6, its first phase in flight
        ("int8", 2, 7, torch.float32),  # fragment 0 sent at 6, its second phase started at 7
    ],
)
def test_state_round_trips_through_a_weights_only_checkpoint_with_an_exchange_in_flight(
    precision: str, overlap: int, save_at: int, dtype: torch.dtype
) -> None:
    options = {**ROUND_TRIP_OPTIONS, "precision": precision, "overlap_steps": overlap}
    with one_rank_group():
        model, state, _ = _run(13, options=options)
        _, _, saved = _run(13, save_at=save_at, options=options)
        checkpoint = torch.load(io.BytesIO(saved), weights_only=True)["diloco"]
        assert checkpoint["per_rank"] == {}
        shared = checkpoint["shared"]
        assert (
            shared["step"] == save_at
            and set(shared["in_flight"]) == {0}
            and shared["in_flight"][0]["apply_at"] == 6 + overlap
        )
        assert shared["in_flight"][0]["mean_delta"].dtype == dtype
        resumed, resumed_state, _ = _run(13, saved=saved, options=options)
        for a, b in zip(model.parameters(), resumed.parameters()):
            assert torch.equal(a, b)
        assert (resumed_state.step, resumed_state.syncs, resumed_state.bytes_sent) == (
            state.step,
            state.syncs,
            state.bytes_sent,
        )
        for a, b in zip(state.anchors, resumed_state.anchors):
            assert torch.equal(a, b)


def test_a_checkpoint_of_another_model_is_refused_by_name() -> None:
    with one_rank_group():
        _, state, saved = _run(4, save_at=4)
        other = DiLoCoState(DiLoCoOptions(period=4))
        other.attach(nn.Linear(5, 5).parameters())
        with pytest.raises(ValueError, match="anchors do not match this model's trainable parameters"):
            other.load_state_dict(torch.load(io.BytesIO(saved), weights_only=True)["diloco"])


def test_bench_has_both_diloco_contenders_and_counts_their_exchanges() -> None:
    from lightning_ddpx.bench.convergence import convergence_contenders_named
    from lightning_ddpx.bench.convergence_worker import _parameter_exchange_bytes
    from lightning_ddpx.hooks.diloco import OuterSync

    diloco, streaming = convergence_contenders_named(["diloco", "streaming-diloco"])
    assert diloco.steps_factor == streaming.steps_factor == 3
    assert diloco.lossy and diloco.strategy["comm_hook"] == "diloco"
    DDPXConfig(**streaming.strategy)  # valid options
    state = DiLoCoState()
    state._new_syncs = [OuterSync(3, 0, 100), OuterSync(3, 1, 28)]
    assert _parameter_exchange_bytes(state, 999) == 128.0
    assert _parameter_exchange_bytes(state, 999) == 0.0  # taken
    averager = SimpleNamespace(step=14, warmup_steps=10, period=4)  # the averager counted step 13: not due
    assert _parameter_exchange_bytes(SimpleNamespace(averager=averager), 999) == 0.0
    averager.step = 15  # counted step 14 = 10 + 4: averaged the whole model
    assert _parameter_exchange_bytes(SimpleNamespace(averager=averager), 999) == 999.0
    assert _parameter_exchange_bytes(None, 999) == 0.0


def test_bench_has_a_sparse_diloco_contender_and_counts_what_it_receives() -> None:
    from lightning_ddpx.bench.convergence import convergence_contenders_named, summarize_runs
    from lightning_ddpx.bench.convergence_worker import _parameter_exchange
    from lightning_ddpx.hooks.diloco import OuterSync

    (sparse,) = convergence_contenders_named(["sparse-diloco"])
    assert DDPXConfig(**sparse.strategy).diloco.sparse.density == 0.04 and sparse.steps_factor == 3
    state = DiLoCoState()
    state._new_syncs = [OuterSync(20, 0, 100, 300)]  # an all-gather on 4 ranks: 3 payloads received
    assert _parameter_exchange(state, 999) == (100.0, 300.0)
    averager = SimpleNamespace(step=15, warmup_steps=10, period=4)
    assert _parameter_exchange(SimpleNamespace(averager=averager), 999) == (999.0, 999.0)
    val = [{"step": 2, "time_s": 1.0, "metric": 0.5, "val_loss": 1.0}]
    runs = {
        "torch-ddp": {
            "time_s": [0.1, 0.2],
            "bytes_sent": [1000.0] * 2,
            "bytes_received": [1000.0] * 2,
            "val": val,
        },
        "sparse-diloco": {
            "time_s": [0.1, 0.2],
            "bytes_sent": [0.0, 10.0],
            "bytes_received": [0.0, 40.0],
            "val": val,
        },
    }
    ddp, row = summarize_runs(convergence_contenders_named(["torch-ddp", "sparse-diloco"]), runs, None)
    assert (row.bytes_vs_torch, row.received_vs_torch) == (200.0, 50.0)
    assert (ddp.bytes_vs_torch, ddp.received_vs_torch) == (1.0, 1.0)


def test_bench_table_reports_bytes_saved_and_recommends_against_torch_ddp_alone() -> None:
    """On the slow link only torch's DDP may be run as the lossless reference: the recommendation still
    considers DiLoCo, and the table says how many times fewer bytes each contender sent."""
    from lightning_ddpx.bench.convergence import (
        convergence_contenders_named,
        default_target,
        recommend_from_convergence,
        summarize_runs,
    )
    from tests.bench.test_bench_convergence import curve

    runs = {
        "torch-ddp": curve(2.0, [0.5, 0.8, 0.90, 0.94, 0.96], sent=1000.0),
        # twice the steps (steps_factor): judged at torch's 50 steps (0.95, 0.955), timed to 0.94 at step 40
        "diloco": curve(0.1, [0.5, 0.8, 0.90, 0.95, 0.955, 0.2, 0.2, 0.2, 0.2, 0.2], sent=5.0),
        "streaming-diloco": curve(0.1, [0.5, 0.7, 0.80, 0.85, 0.90], sent=5.0),  # outside tolerance
    }
    rows = summarize_runs(convergence_contenders_named(list(runs)), runs, default_target(runs, "max", 0.01))
    by_name = {r.name: r for r in rows}
    assert by_name["diloco"].bytes_vs_torch == pytest.approx(200.0)
    assert by_name["diloco"].vs_torch == pytest.approx(4.0 / 80.0)
    assert by_name["diloco"].final_metric == pytest.approx(0.9525) and by_name["diloco"].steps == 100
    assert by_name["diloco"].extra["final_at_end"] == pytest.approx(0.2)
    assert by_name["diloco"].bytes_to_target == pytest.approx(40 * 5.0)  # reached at step 40
    assert by_name["torch-ddp"].bytes_to_target == pytest.approx(40 * 1000.0)
    advice = recommend_from_convergence(rows, "val_acc", 0.01)
    assert advice.startswith("Recommended: diloco -> DDPXStrategy(comm_hook='diloco'"), advice
    assert "0.05x torch-ddp's time" in advice and "streaming-diloco (val_acc 0.8750 vs 0.9500)" in advice


def test_outer_sync_metrics_give_each_exchange_and_the_running_total() -> None:
    from lightning_ddpx.hooks.diloco import OuterSync
    from lightning_ddpx.lightning.features.diloco_setup import outer_sync_metrics

    state = DiLoCoState()
    state.bytes_sent, state.bytes_received = 300, 900
    state._new_syncs = [OuterSync(4, 0, 100, 300), OuterSync(8, 1, 50, 150)]
    fabric_model = SimpleNamespace(_forward_module=SimpleNamespace(comm_hook_state=state))
    assert outer_sync_metrics(fabric_model) == [
        {
            "ddpx/outer_sync_bytes": 100.0,
            "ddpx/outer_sync_bytes_received": 300.0,
            "ddpx/outer_sync_fragment": 0.0,
            "ddpx/outer_bytes_total": 250.0,
            "ddpx/outer_bytes_received_total": 750.0,
        },
        {
            "ddpx/outer_sync_bytes": 50.0,
            "ddpx/outer_sync_bytes_received": 150.0,
            "ddpx/outer_sync_fragment": 1.0,
            "ddpx/outer_bytes_total": 300.0,
            "ddpx/outer_bytes_received_total": 900.0,
        },
    ]
    assert outer_sync_metrics(state) == [] and outer_sync_metrics(nn.Linear(2, 2)) == []


def test_global_parameters_hold_the_anchors_inside_and_restore_the_replica_after() -> None:
    with one_rank_group():
        model, state, _ = _run(6)  # period 4, 2 fragments: the replica has drifted from the anchors
        local = [p.detach().clone() for p in model.parameters()]
        assert any(not torch.equal(p, a) for p, a in zip(local, state.anchors))
        with state.global_parameters():
            for p, a in zip(model.parameters(), state.anchors):
                assert torch.equal(p, a)
        for p, saved in zip(model.parameters(), local):
            assert torch.equal(p, saved)


def test_the_convergence_bench_validates_diloco_on_the_global_model() -> None:
    """The papers evaluate the outer (global) model, equal on every rank; validating each rank's drifted
    replica (and averaging their losses) measures another model. The recorder swaps the anchors in for
    validation and restores the replica for training."""
    from lightning_ddpx.bench.convergence_worker import CurveRecorder

    with one_rank_group():
        model, state, _ = _run(6)
        local = [p.detach().clone() for p in model.parameters()]
        trainer = SimpleNamespace(
            strategy=SimpleNamespace(comm_hook_state=state),
            sanity_checking=False,
            global_step=6,
            callback_metrics={"val_acc": torch.tensor(0.5), "val_loss": torch.tensor(1.0)},
        )
        seen = []
        for evaluate, expected in (("global", state.anchors), ("local", local)):
            recorder = CurveRecorder("val_acc", 0, verbose=False, evaluate=evaluate)
            recorder.on_validation_start(trainer, None)
            seen.append(all(torch.equal(p, e) for p, e in zip(model.parameters(), expected)))
            recorder.on_validation_end(trainer, None)
            assert all(torch.equal(p, saved) for p, saved in zip(model.parameters(), local))
        assert seen == [True, True]


@pytest.mark.parametrize("bits", [8, 4])
def test_a_non_finite_change_stays_non_finite_through_the_codes(bits: int) -> None:
    """A diverged replica (NaN or inf in its change) must show as non-finite values in the mean, as with an fp32
    all-reduce, never as finite codes that would train on silently."""
    rows = torch.ones(3, 2 * BLOCK)
    rows[0, 5], rows[1, BLOCK + 7] = float("nan"), float("inf")
    decoded = dequantize(quantize(rows, bits), bits, 2 * BLOCK)
    assert not decoded[0, :BLOCK].isfinite().any() and not decoded[1, BLOCK:].isfinite().any()
    # the other blocks decode exactly (ones)
    assert torch.equal(decoded[0, BLOCK:], rows[0, BLOCK:]) and torch.equal(decoded[2], rows[2])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_a_fragment_of_empty_parameters_trains_in_every_precision(precision: str) -> None:
    """A zero-element parameter may form a fragment on its own: its exchange sends nothing and applies
    nothing, and the other fragment's outer steps go on (int8/int4 used to fail on the empty codes)."""
    with one_rank_group():
        params = [torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.empty(0))]
        state = DiLoCoState(DiLoCoOptions(period=2, fragments=2, precision=precision))
        state.attach(params)
        assert state.fragment_of == [0, 1]
        initial = params[0].detach().clone()
        for _ in range(4):
            with torch.no_grad():
                params[0].add_(0.1)
            state.averager.average_parameters(None)
        assert state.syncs == 4 and params[1].numel() == 0
        assert not torch.equal(state.anchors[0], initial)  # the outer steps moved the other fragment


# ------------------------------------------------- the same bits whichever device a rank computes on
RULES = {"the CPU's": contextlib.nullcontext, "CUDA's": CudaDivisionRule}


def blocks_where_the_reciprocal_misses(qmax: int, count: int) -> torch.Tensor:
    """``count`` blocks (rows of :data:`BLOCK` values) whose largest magnitude ``a`` has
    ``a * float32(1 / qmax) != a / qmax`` correctly rounded: blocks whose scale CUDA would get wrong if the
    codec divided by the number ``qmax`` (about 1 in 2 magnitudes for int4's 7, 1 in 20 for int8's 127)."""
    generator = torch.Generator().manual_seed(qmax)
    candidates = torch.rand(100 * count, generator=generator) * torch.logspace(-20, 20, 100 * count)
    reciprocal = torch.ones(()) / torch.full((), float(qmax))
    amax = candidates[candidates * reciprocal != correctly_rounded_quotient(candidates, qmax)][:count]
    assert amax.numel() == count
    blocks = (torch.rand(count, BLOCK, generator=generator) * 2 - 1) * amax[:, None]
    signs = torch.where(torch.arange(count) % 2 == 0, 1.0, -1.0)
    blocks[torch.arange(count), torch.arange(count) % BLOCK] = signs * amax  # the largest, at any place
    return blocks


@pytest.mark.parametrize("count", [2, 3, 7, 127, 1000])
def test_divide_is_correctly_rounded_under_cudas_rule_where_dividing_by_a_number_is_not(count: int) -> None:
    generator = torch.Generator().manual_seed(count)
    values = torch.randn(10_007, generator=generator) * torch.logspace(-30, 30, 10_007)
    exact = correctly_rounded_quotient(values, count)
    assert torch.equal(values / count, exact)  # the CPU divides
    assert torch.equal(divide(values, count), exact)
    rule = CudaDivisionRule()
    with rule:
        by_tensor, by_number = divide(values, count), values / count
    assert rule.replaced == 1  # the division by the number, not the one by a tensor
    assert torch.equal(by_tensor, exact)
    if count & (count - 1):  # no exact reciprocal: CUDA's rule misses some quotients
        assert not torch.equal(by_number, exact)
    else:
        assert torch.equal(by_number, exact)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("bits", [8, 4])
def test_each_scale_is_the_correctly_rounded_quotient_under_either_rule(bits: int, rule: str) -> None:
    """Each block's scale is ``amax / qmax`` correctly rounded, and the bytes are the same, whether a
    division by a number is computed as the CPU does or as CUDA does: on blocks where CUDA's rule would give
    another scale, and on random blocks of magnitudes from 1e-8 to 1e8."""
    qmax = 2 ** (bits - 1) - 1
    hard = blocks_where_the_reciprocal_misses(qmax, 64).reshape(8, 8 * BLOCK)
    generator = torch.Generator().manual_seed(bits)
    random = torch.randn(8, 8 * BLOCK, generator=generator) * torch.logspace(-8, 8, 8).view(8, 1)
    blocks = torch.cat([hard, random])
    with RULES[rule]():
        payload = quantize(blocks, bits)
    scales = payload[:, 8 * BLOCK * bits // 8 :].contiguous().view(torch.float32)
    amax = blocks.view(16, 8, BLOCK).abs().amax(dim=2)
    assert torch.equal(scales, correctly_rounded_quotient(amax, qmax))
    assert torch.equal(payload, quantize(blocks, bits))


def exchange_under_both_rules(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's int8 and int4 exchanges of the same change, computed under the CPU's and CUDA's rules."""
    generator = torch.Generator().manual_seed(rank)
    delta = torch.randn(3000, generator=generator) * torch.logspace(-4, 1, 3000)
    out = {}
    for precision in ("int8", "int4"):
        for rule, context in RULES.items():
            with context():
                exchange = start_exchange(delta.clone(), precision, None, async_op=False, what="a test delta")
                out[f"{precision} {rule}"] = exchange.result().clone()
    return out


@pytest.mark.slow
@pytest.mark.processes
def test_quantized_means_are_the_same_bits_under_either_devices_rule_on_three_ranks() -> None:
    """Three ranks, so that the mean's division by the world size has no exact reciprocal: each rank's mean
    is the same bits under the CPU's and CUDA's rules, and on every rank (``tests/engine/test_cuda.py`` runs the
    exchange on CUDA tensors)."""
    results = run_distributed(exchange_under_both_rules, 3, timeout=120)
    for precision in ("int8", "int4"):
        reference = results[0][f"{precision} the CPU's"]
        for out in results:
            for rule in RULES:
                assert torch.equal(out[f"{precision} {rule}"], reference), (precision, rule)


def _train_overlapped(complete_at_send: bool, precision: str) -> list[torch.Tensor]:
    """12 inner steps of streaming DiLoCo with overlap on this rank's own data; its parameters and anchors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    options = {"period": 4, "fragments": 2, "overlap_steps": 2, "mixing": 0.3, "precision": precision}
    state = DiLoCoState(DiLoCoOptions(**options))
    state.attach(model.parameters())
    state.complete_at_send = complete_at_send
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    rank = torch.distributed.get_rank()
    for step in range(12):
        _step(model, state, optimizer, 100 * rank + step)  # each rank its own data: the means matter
        if step + 1 == 2:  # fragment 0 was sent: its mean known at once only when completed at send
            assert isinstance(state._in_flight[0].exchange, CompletedMean) == complete_at_send
    return [p.detach().clone() for p in model.parameters()] + [a.clone() for a in state.anchors]


def overlapped_both_ways(rank: int, world_size: int) -> dict[str, bool]:
    torch.set_num_threads(1)
    same = {}
    for precision in ("fp32", "int8"):
        in_flight = _train_overlapped(False, precision)
        completed = _train_overlapped(True, precision)
        same[precision] = all(torch.equal(a, b) for a, b in zip(in_flight, completed))
    return same


@pytest.mark.processes
def test_exchanges_completed_at_send_give_the_same_bits_as_exchanges_in_flight() -> None:
    """The fault tolerance completes each exchange within the step that sends it (complete_at_send);
    applied ``overlap_steps`` later and mixed as usual, the parameters and anchors are bitwise those of the
    exchanges left in flight, on two ranks with their own data, in full precision and quantized."""
    for outcome in run_distributed(overlapped_both_ways, 2, timeout=120):
        assert outcome == {"fp32": True, "int8": True}, outcome


# ---------------------------------------------------------------------------------- the sparse exchange
SPARSE = {"period": 4, "fragments": 2, "overlap_steps": 1, "sparse": {"density": 0.3, "bits": 2, "chunk": 8}}


@pytest.mark.parametrize(
    ("sparse", "error", "match"),
    [
        ({"density": 0}, ValueError, r"sparse.density must be a number in \(0, 1\]"),
        ({"bits": 1}, ValueError, r"sparse.bits must be one of \[2, 4, 8\]"),
        ({"chunk": 64.0}, TypeError, "sparse: chunk must be an integer"),
        ({"decay": 0.9}, TypeError, r"unknown diloco option\(s\) sparse.\['decay'\]"),
        ("2%", TypeError, "diloco option sparse must be a dict"),
    ],
)
def test_bad_sparse_options_are_refused_by_the_strategy_by_name(sparse, error, match) -> None:
    with pytest.raises(error, match=match):
        DDPXConfig(comm_hook="diloco", diloco={"period": 4, "sparse": sparse})


def test_sparse_options_come_from_a_dict_or_true_and_refuse_a_precision() -> None:
    from lightning_ddpx.hooks.sparse_exchange import SparseOptions

    config = DDPXConfig(comm_hook="diloco", diloco={"period": 4, "sparse": {"density": 0.01, "bits": 4}})
    assert config.diloco.sparse == SparseOptions(density=0.01, bits=4)
    assert DiLoCoOptions(sparse=True).sparse == SparseOptions()
    assert DiLoCoOptions.from_dict({"sparse": None}).sparse is None
    with pytest.raises(ValueError, match="sparse and precision='int4' together"):
        DiLoCoOptions(precision="int4", sparse={})


def test_sparse_state_round_trips_every_ranks_errors_through_a_weights_only_checkpoint() -> None:
    with one_rank_group():
        model, state, _ = _run(13, options=SPARSE)
        _, saved_state, saved = _run(13, save_at=6, options=SPARSE)  # fragment 0 sent at 6, in flight
        checkpoint = torch.load(io.BytesIO(saved), weights_only=True)["diloco"]
        errors = checkpoint["per_rank"]["errors"]
        assert [e.shape for e in errors] == [p.shape for p in model.parameters()]
        assert all(e.dtype == torch.float32 for e in errors) and any(e.abs().sum() > 0 for e in errors)
        resumed, resumed_state, _ = _run(13, saved=saved, options=SPARSE)
        for a, b in zip(model.parameters(), resumed.parameters()):
            assert torch.equal(a, b)
        for a, b in zip(state.errors, resumed_state.errors):
            assert torch.equal(a, b)
        assert (resumed_state.bytes_sent, resumed_state.bytes_received) == (state.bytes_sent, 0)
        # a newcomer (or another world size) gets the shared part only: its error buffers start at zero
        resumed_state.load_state_dict({"shared": checkpoint["shared"], "per_rank": {}})
        assert not any(e.any() for e in resumed_state.errors)


def test_sparse_exchange_sends_and_counts_the_stated_payload() -> None:
    from lightning_ddpx.hooks.sparse_exchange import SparseCodec

    with one_rank_group():
        model, state, _ = _run(8, options=SPARSE)
    options = DiLoCoOptions(**SPARSE).sparse
    sizes = [
        SparseCodec(
            [p.numel() for i, p in enumerate(model.parameters()) if state.fragment_of[i] == f], options
        )
        for f in (0, 1)
    ]
    syncs = state.take_syncs()
    assert [(s.step, s.fragment) for s in syncs] == [(2, 0), (4, 1), (6, 0), (8, 1)]
    assert [s.bytes_sent for s in syncs] == [sizes[s.fragment].payload_bytes for s in syncs]
    assert state.bytes_sent == sum(s.bytes_sent for s in syncs) and state.bytes_received == 0
