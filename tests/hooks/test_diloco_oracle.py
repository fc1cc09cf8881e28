"""DiLoCo and streaming DiLoCo against a reference written from the papers' algorithms, on 2 and 3 ranks.

The reference (:func:`reference_run`) simulates every replica in this process, with nothing of ours:
DiLoCo (arXiv 2311.08105, Algorithm 1) -- each replica takes H inner AdamW steps on its own data, the outer
gradient is the mean of ``global - local``, Nesterov SGD steps the global parameters, replicas restart from
them -- and streaming DiLoCo (arXiv 2501.18512, Algorithm 2) -- fragment ``p`` is sent when
``(t - t_p) % H == 0`` (``t_p = (p + 1) H / F``), its mean arrives ``tau`` steps later, the outer step gives
the fragment's new global value ``g`` and each replica mixes ``alpha * local + (1 - alpha) * g``; the delta
optionally cast to bf16/fp16 and divided by the world size before it is summed, or quantized to int8/int4
(blocks of 128 elements, each scaled by its largest magnitude, rounded to nearest): each replica's delta
quantized, the mean of the decoded values taken in fp32, quantized again and decoded. Ours runs the real path: the
module of :class:`DDPXConfig` with ``comm_hook="diloco"`` (gradients must stay local) and the state's
averager after each optimizer step. Every rank's parameters, and the anchors, must equal the reference's
within 1e-6 after a number of steps that ends between two syncs (so replicas differ).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ddpx.hooks.diloco import DiLoCoOptions
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.processes]

CASES = {
    "diloco": ({"period": 4}, 11),
    "diloco_sgd_outer": ({"period": 3, "outer_lr": 0.5, "outer_momentum": 0.8, "nesterov": False}, 10),
    "streaming": ({"period": 6, "fragments": 3, "overlap_steps": 1, "mixing": 0.5}, 16),
    "streaming_overlap2": ({"period": 4, "fragments": 2, "overlap_steps": 2, "outer_lr": 0.9}, 13),
    "streaming_bf16": ({"period": 4, "fragments": 2, "overlap_steps": 1, "precision": "bf16"}, 13),
    "streaming_fp16": ({"period": 4, "fragments": 3, "overlap_steps": 0, "precision": "fp16"}, 13),
    "diloco_int8": ({"period": 4, "precision": "int8"}, 11),
    "streaming_int4": (
        {"period": 6, "fragments": 3, "overlap_steps": 2, "mixing": 0.5, "precision": "int4"},
        16,
    ),
    "streaming_int8_overlap1": ({"period": 4, "fragments": 2, "overlap_steps": 1, "precision": "int8"}, 13),
}
# Low-precision sums of 3 addends depend on the backend's order; with 2 ranks the sum is exact either way.
LOW_PRECISION = {"streaming_bf16", "streaming_fp16"}
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
BITS = {"int8": 8, "int4": 4}
BLOCK = 128


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The documented rounding, block by block: scale = largest magnitude / qmax, x -> round(x / scale) * scale."""
    qmax = 2 ** (bits - 1) - 1
    out = torch.zeros_like(x)
    for start in range(0, x.numel(), BLOCK):
        block = x[start : start + BLOCK]
        scale = block.abs().max() / qmax
        if scale > 0:
            out[start : start + BLOCK] = torch.round(block / scale).clamp(-qmax, qmax) * scale
    return out


def quantized_mean(deltas: list[torch.Tensor], bits: int) -> torch.Tensor:
    """Each replica's flat delta quantized, the decoded values averaged in fp32 (in rank order), the mean
    quantized again and decoded."""
    n = deltas[0].numel()
    padded = [torch.cat([d, torch.zeros(-n % BLOCK)]) for d in deltas]
    total = None
    for d in padded:
        decoded = fake_quantize(d, bits)
        total = decoded if total is None else total + decoded
    return fake_quantize(total / len(deltas), bits)[:n]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))


def inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)


def data(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(steps)
    ]


# ------------------------------------------------------------------------------------------ reference
def fragments_by_rule(model: nn.Module, count: int) -> list[int]:
    """The documented split: parameter i in fragment floor(F * elements before i / total elements)."""
    numels = [p.numel() for p in model.parameters()]
    total, before, out = sum(numels), 0, []
    for n in numels:
        out.append(before * count // total)
        before += n
    return out


def reference_run(options: dict, world_size: int, steps: int) -> dict:
    o = DiLoCoOptions(**options)
    H, F, tau, alpha, mu, lr = o.period, o.fragments, o.overlap_steps, o.mixing, o.outer_momentum, o.outer_lr
    dtype = DTYPES.get(o.precision)
    replicas = [make_model() for _ in range(world_size)]
    optimizers = [inner_optimizer(m) for m in replicas]
    batches = [data(m, steps) for m in range(world_size)]
    params = [list(m.parameters()) for m in replicas]
    global_ = [p.detach().clone() for p in params[0]]
    velocity: list[torch.Tensor | None] = [None] * len(global_)
    fragment_of = fragments_by_rule(replicas[0], F)
    arriving: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for t in range(1, steps + 1):
        for m in range(world_size):
            x, y = batches[m][t - 1]
            optimizers[m].zero_grad()
            nn.functional.mse_loss(replicas[m](x), y).backward()
            optimizers[m].step()
        with torch.no_grad():
            for f in range(F):
                t_f = (f + 1) * H // F
                if t >= t_f and (t - t_f) % H == 0:
                    members = [i for i, g in enumerate(fragment_of) if g == f]
                    mean = []
                    if o.precision in BITS:
                        flat = [torch.cat([(global_[i] - params[m][i]).reshape(-1) for i in members])
                                for m in range(world_size)]  # fmt: skip
                        averaged, offset = quantized_mean(flat, BITS[o.precision]), 0
                        for i in members:
                            mean.append(averaged[offset : offset + global_[i].numel()].view_as(global_[i]))
                            offset += global_[i].numel()
                    else:
                        for i in members:
                            total = None
                            for m in range(world_size):
                                delta = global_[i] - params[m][i]
                                delta = (delta.to(dtype) if dtype else delta) / world_size
                                total = delta if total is None else total + delta
                            mean.append(total.float())
                    arriving[f] = (t + tau, mean)
            for f in sorted(arriving):
                due, mean = arriving[f]
                if due != t:
                    continue
                del arriving[f]
                for i, delta in zip((i for i, g in enumerate(fragment_of) if g == f), mean):
                    velocity[i] = delta.clone() if velocity[i] is None else mu * velocity[i] + delta
                    direction = delta + mu * velocity[i] if o.nesterov else velocity[i]
                    global_[i] = global_[i] - lr * direction
                    for m in range(world_size):
                        params[m][i].copy_(alpha * params[m][i] + (1 - alpha) * global_[i])
    return {
        "replicas": [[p.detach().clone() for p in ps] for ps in params],
        "global": global_,
        "fragment_of": fragment_of,
    }


# ----------------------------------------------------------------------------------------------- ours
def our_run(rank: int, world_size: int, options: dict, steps: int) -> dict:
    from lightning_ddpx.lightning.settings.config import DDPXConfig

    config = DDPXConfig(comm_hook="diloco", diloco=options)
    module = config.wrap(make_model())
    state = config.register_hook(module)
    optimizer = inner_optimizer(module)
    for x, y in data(rank, steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
        state.averager.average_parameters(optimizer.param_groups)
    state.finish()
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "anchors": [a.clone() for a in state.anchors],
        "fragment_of": list(state.fragment_of),
        "step": state.step,
        "syncs": state.syncs,
        "bytes": state.bytes_sent,
    }


def job(rank: int, world_size: int, names: list[str]) -> dict:
    return {name: our_run(rank, world_size, *CASES[name]) for name in names}


@pytest.fixture(scope="module")
def outcomes() -> dict[int, list[dict]]:
    return {
        2: run_distributed(job, 2, list(CASES), timeout=240),
        3: run_distributed(job, 3, [n for n in CASES if n not in LOW_PRECISION], timeout=240),
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_equals_the_papers_algorithm(outcomes, world_size: int, name: str) -> None:
    if world_size == 3 and name in LOW_PRECISION:
        pytest.skip("low-precision sums of three addends depend on the backend's order")
    options, steps = CASES[name]
    reference = reference_run(options, world_size, steps)
    for rank, out in enumerate(outcomes[world_size]):
        ours = out[name]
        assert ours["fragment_of"] == reference["fragment_of"]
        assert ours["step"] == steps
        for i, (a, b) in enumerate(zip(ours["params"], reference["replicas"][rank])):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{name} rank {rank} parameter {i}")
        for i, (a, b) in enumerate(zip(ours["anchors"], reference["global"])):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{name} rank {rank} anchor {i}")
    # the replicas really did train apart (the comparison above is not between untouched copies)
    first, second = outcomes[world_size][0][name]["params"], outcomes[world_size][1][name]["params"]
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(first, second))


def test_bytes_per_sync_follow_fragment_size_and_precision(outcomes) -> None:
    model = make_model()
    total = sum(p.numel() for p in model.parameters())
    for name in ("diloco", "streaming_bf16", "streaming_fp16"):
        options, steps = CASES[name]
        o = DiLoCoOptions(**options)
        element = 4 if o.precision == "fp32" else 2
        sends = sum(
            max(0, (steps - o.offset(f)) // o.period + 1)
            * sum(
                p.numel() for p, g in zip(model.parameters(), fragments_by_rule(model, o.fragments)) if g == f
            )
            for f in range(o.fragments)
        )
        out = outcomes[2][0][name]
        assert out["bytes"] == sends * element, name
    assert outcomes[2][0]["diloco"]["bytes"] == 2 * total * 4  # steps 4 and 8 of 11


def test_quantized_exchanges_carry_codes_and_a_scale_per_block(outcomes) -> None:
    # 119 elements in one fragment, padded to one block of 128 per rank: a row of 128 int8 codes and one
    # 4-byte scale per rank, sent at steps 4 and 8 of 11
    assert outcomes[2][0]["diloco_int8"]["bytes"] == 2 * 2 * (128 + 4)
    assert outcomes[3][0]["diloco_int8"]["bytes"] == 2 * 3 * (128 + 4)


@pytest.mark.parametrize("world_size", [2, 3])
def test_quantized_means_are_the_same_bits_on_every_rank(outcomes, world_size: int) -> None:
    for name in ("diloco_int8", "streaming_int4", "streaming_int8_overlap1"):
        first = outcomes[world_size][0][name]["anchors"]
        for out in outcomes[world_size][1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, out[name]["anchors"])), name
