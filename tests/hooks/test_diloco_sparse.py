"""DiLoCo's sparse, error-fed outer exchange on 2 and 3 ranks against a dense reference of the algorithm.

The reference (:func:`reference_run`) simulates every replica in this process with nothing of ours: each
replica's change since the last outer step plus its error buffer (decayed), ``acc``; of every chunk of each
tensor (chunks of ``min(chunk, numel)`` elements, the last one zero-padded) the ``k`` largest magnitudes
kept, each rounded to the nearest odd multiple of the chunk's scale (its largest kept magnitude over
``2 ** bits - 1``); the rest, and the rounding, the replica's new error buffer; the outer gradient the mean
of what the replicas sent, in rank order; Nesterov SGD (or plain SGD) on the global parameters; streaming
DiLoCo's fragments, overlap and mixing as in tests/hooks/test_diloco_oracle.py. Ours runs the module of
:class:`DDPXConfig` with ``comm_hook="diloco"``. After every step each rank's parameters, anchors and error
buffers equal the reference's within 1e-6, and the anchors are bit-identical on every rank after every outer
step (the parameters too, where nothing is mixed).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ddpx.hooks.diloco import DiLoCoOptions
from tests.dist_utils import run_distributed
from tests.hooks.test_diloco_oracle import data, fragments_by_rule, inner_optimizer, make_model

pytestmark = [pytest.mark.slow, pytest.mark.processes]

CASES = {
    "diloco_2bit": (
        {"period": 3, "sparse": {"density": 0.25, "bits": 2, "chunk": 16, "error_decay": 0.9}},
        10,
    ),
    "streaming_4bit": (
        {
            "period": 4,
            "fragments": 2,
            "overlap_steps": 1,
            "mixing": 0.5,
            "sparse": {"density": 0.2, "bits": 4, "chunk": 16},
        },
        13,
    ),
    "sgd_8bit": (
        {
            "period": 3,
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
            "nesterov": False,
            "sparse": {"density": 0.1, "bits": 8, "chunk": 32, "error_decay": 1.0},
        },
        10,
    ),
}


# ------------------------------------------------------------------------------------------ reference
def sparse_sent(acc: torch.Tensor, density: float, bits: int, chunk: int) -> torch.Tensor:
    """What one replica sends of one tensor's ``acc``, dense: k per chunk, on its chunk's levels."""
    flat = acc.reshape(-1)
    size = min(chunk, flat.numel())
    k = min(size, max(1, round(density * size)))
    levels = 2**bits - 1
    out = torch.zeros(-(-flat.numel() // size) * size)
    padded = torch.cat([flat, torch.zeros(out.numel() - flat.numel())])
    for start in range(0, out.numel(), size):
        piece = padded[start : start + size]
        top = piece.abs().topk(k).indices
        scale = piece[top].abs().max() / levels
        if scale > 0:
            code = torch.round((piece[top] / scale + levels) / 2).clamp(0, levels)
            out[start + top] = (2 * code - levels) * scale
    return out[: flat.numel()].view_as(acc)


def reference_run(options: dict, world_size: int, steps: int) -> list[dict]:
    o = DiLoCoOptions(**options)
    s = o.sparse
    H, F, tau, alpha, mu, lr = o.period, o.fragments, o.overlap_steps, o.mixing, o.outer_momentum, o.outer_lr
    replicas = [make_model() for _ in range(world_size)]
    optimizers = [inner_optimizer(m) for m in replicas]
    batches = [data(m, steps) for m in range(world_size)]
    params = [list(m.parameters()) for m in replicas]
    global_ = [p.detach().clone() for p in params[0]]
    errors = [[torch.zeros_like(p) for p in ps] for ps in params]
    velocity: list[torch.Tensor | None] = [None] * len(global_)
    fragment_of = fragments_by_rule(replicas[0], F)
    arriving: dict[int, tuple[int, list[torch.Tensor]]] = {}
    history = []
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
                    mean = []
                    for i in (i for i, g in enumerate(fragment_of) if g == f):
                        total = None
                        for m in range(world_size):
                            acc = (global_[i] - params[m][i]) + s.error_decay * errors[m][i]
                            sent = sparse_sent(acc, s.density, s.bits, s.chunk)
                            errors[m][i] = acc - sent
                            total = sent if total is None else total + sent
                        mean.append(total / world_size)
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
        history.append(
            {
                "replicas": [[p.detach().clone() for p in ps] for ps in params],
                "global": [g.clone() for g in global_],
                "errors": [[e.clone() for e in es] for es in errors],
            }
        )
    return history


# ----------------------------------------------------------------------------------------------- ours
def our_run(rank: int, world_size: int, options: dict, steps: int) -> dict:
    from lightning_ddpx.lightning.settings.config import DDPXConfig

    config = DDPXConfig(comm_hook="diloco", diloco=options)
    module = config.wrap(make_model())
    state = config.register_hook(module)
    optimizer = inner_optimizer(module)
    history, outer_steps = [], []
    for x, y in data(rank, steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
        if state.averager.average_parameters(optimizer.param_groups):
            outer_steps.append(state.step)
        history.append(
            {
                "params": [p.detach().clone() for p in module.parameters()],
                "anchors": [a.clone() for a in state.anchors],
                "errors": [e.clone() for e in state.errors],
            }
        )
    return {
        "history": history,
        "outer_steps": outer_steps,
        "bytes": (state.bytes_sent, state.bytes_received),
        "syncs": [(s.fragment, s.bytes_sent, s.bytes_received) for s in state.take_syncs()],
    }


def job(rank: int, world_size: int) -> dict:
    return {name: our_run(rank, world_size, *CASES[name]) for name in CASES}


@pytest.fixture(scope="module")
def outcomes() -> dict[int, list[dict]]:
    return {w: run_distributed(job, w, timeout=240) for w in (2, 3)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_equals_the_dense_reference_after_every_step(outcomes, world_size: int, name: str) -> None:
    options, steps = CASES[name]
    reference = reference_run(options, world_size, steps)
    for rank, out in enumerate(outcomes[world_size]):
        for t, (ours, theirs) in enumerate(zip(out[name]["history"], reference), start=1):
            where = f"{name}, rank {rank}, after step {t}"
            for i, (a, b) in enumerate(zip(ours["params"], theirs["replicas"][rank])):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{where}: parameter {i}")
            for i, (a, b) in enumerate(zip(ours["anchors"], theirs["global"])):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{where}: anchor {i}")
            for i, (a, b) in enumerate(zip(ours["errors"], theirs["errors"][rank])):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{where}: error buffer {i}")
    # the error buffers hold something, and differ between the ranks (each keeps its own)
    last = [out[name]["history"][-1]["errors"] for out in outcomes[world_size]]
    assert any(e.abs().max() > 1e-4 for e in last[0])
    assert any(not torch.equal(a, b) for a, b in zip(last[0], last[1]))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_replicas_are_bit_identical_after_every_outer_step(outcomes, world_size: int, name: str) -> None:
    options, _ = CASES[name]
    mixed = DiLoCoOptions(**options).mixing > 0
    first, *others = outcomes[world_size]
    assert first[name]["outer_steps"], "no outer step ran"
    for out in others:
        assert out[name]["outer_steps"] == first[name]["outer_steps"]
        for t in first[name]["outer_steps"]:
            mine, theirs = first[name]["history"][t - 1], out[name]["history"][t - 1]
            assert all(torch.equal(a, b) for a, b in zip(mine["anchors"], theirs["anchors"])), (name, t)
            if not mixed:
                assert all(torch.equal(a, b) for a, b in zip(mine["params"], theirs["params"])), (name, t)


def test_every_rank_counts_its_payload_sent_and_the_others_received(outcomes) -> None:
    from lightning_ddpx.hooks.sparse_exchange import SparseCodec

    model = make_model()
    for world_size in (2, 3):
        for name, (options, _) in CASES.items():
            o = DiLoCoOptions(**options)
            fragment_of = fragments_by_rule(model, o.fragments)
            for out in outcomes[world_size]:
                for fragment, sent, received in out[name]["syncs"]:
                    numels = [p.numel() for p, f in zip(model.parameters(), fragment_of) if f == fragment]
                    assert sent == SparseCodec(numels, o.sparse).payload_bytes
                    assert received == (world_size - 1) * sent
                assert out[name]["bytes"] == (
                    sum(s[1] for s in out[name]["syncs"]),
                    sum(s[2] for s in out[name]["syncs"]),
                )
