"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) against torch's DDP.

A model with a sparse embedding, a sparse embedding bag and dense layers trains side by side with torch's
DDP on rank-dependent indices; after every SGD step the gradients (as dense tensors; ours must stay sparse)
and the parameters must equal torch's within 1e-6. Where torch's DDP cannot run a case (an embedding unused
on one rank with ``find_unused_parameters``: torch raises "Expected sparse gradient to be defined"), the
oracle is torch's DDP on the same model with dense embeddings: the same mathematics.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import lightning_ddpx
from lightning_ddpx import hooks
from lightning_ddpx.engine.buckets.plan import plan_buckets
from tests.dist_utils import one_rank_group, run_distributed
from tests.oracle import assert_same_tensors, default_path, set_shared_memory

SMALL_BUCKETS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0002}
STEPS = 5
TOLERANCE = 1e-6


class Embedded(nn.Module):
    """A sparse embedding and a sparse embedding bag feeding two dense layers."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=sparse)
        self.bag = nn.EmbeddingBag(40, 8, mode="sum", sparse=sparse)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, idx: torch.Tensor, bag_idx: torch.Tensor, use_bag: bool = True) -> torch.Tensor:
        e = self.emb(idx).mean(1)
        b = self.bag(bag_idx) if use_bag else torch.zeros_like(e)
        return self.fc2(torch.relu(self.fc1(torch.cat([e, b], 1))))


def batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent indices (each rank touches other rows, with repeats: uncoalesced gradients)."""
    g = torch.Generator().manual_seed(100 * micro + rank)
    idx = torch.randint(10 * rank, 10 * rank + 25, (6, 3), generator=g)
    bag_idx = torch.randint(0, 20 + 10 * rank, (6, 4), generator=g)
    return idx, bag_idx


def _loss(model: nn.Module, micro: int, use_bag: bool = True) -> torch.Tensor:
    rank = dist.get_rank()
    idx, bag_idx = batch(rank, micro)
    return model(idx, bag_idx, use_bag).pow(2).mean() * (rank + 1)


def _dense_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.to_dense() for n, p in model.module.named_parameters()}


SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "default_gloo": {"shared_memory": False},
    "as_view": {"kwargs": {"gradient_as_bucket_view": True}},
    "find_unused": {"kwargs": {"find_unused_parameters": True}},
    "no_sync": {"accumulate": 2},
    "no_sync_find_unused": {"accumulate": 2, "kwargs": {"find_unused_parameters": True}},
    "static_graph": {"kwargs": {"static_graph": True}, "accumulate": 2, "sync_first": True},
    "allreduce_hook": {"hook": (hooks.allreduce_hook, default_hooks.allreduce_hook)},
    "torch_allreduce_hook": {"hook": (default_hooks.allreduce_hook, default_hooks.allreduce_hook)},
    "overlap_optimizer": {"overlap": True},
    # torch's sparse DDP refuses these (an undefined sparse gradient): its dense twin is the oracle
    "bag_unused_on_rank1": {
        "kwargs": {"find_unused_parameters": True},
        "bag_plan": "rank1_never",
        "dense": True,
    },
    "bag_only_in_no_sync": {
        "kwargs": {"find_unused_parameters": True},
        "bag_plan": "rank0_in_no_sync",
        "accumulate": 2,
        "dense": True,
    },
    "bag_unused_everywhere_on_odd_steps": {
        "kwargs": {"find_unused_parameters": True},
        "bag_plan": "even_steps",
        "dense": True,
    },
}


def _uses_bag(plan: str | None, rank: int, step: int, k: int, accumulate: int) -> bool:
    if plan == "rank1_never":
        return rank == 0
    if plan == "rank0_in_no_sync":
        return rank == 0 and k < accumulate - 1
    if plan == "even_steps":
        return step % 2 == 0
    return True


def side_by_side(rank: int, scenario: dict[str, Any]) -> dict[str, Any]:
    set_shared_memory(scenario.get("shared_memory", True))
    kwargs = {**SMALL_BUCKETS, **scenario.get("kwargs", {})}
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "first_bucket_cap_mb"}
    torch.manual_seed(0)
    base = Embedded()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    twin = copy.deepcopy(base)
    if scenario.get("dense"):
        twin.emb.sparse = twin.bag.sparse = False
    theirs = torch.nn.parallel.DistributedDataParallel(twin, **torch_kwargs)
    if "hook" in scenario:
        our_hook, torch_hook = scenario["hook"]
        ours.register_comm_hook(None, our_hook)
        theirs.register_comm_hook(None, torch_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, theirs)]
    overlap = scenario.get("overlap", False)
    if overlap:
        ours.overlap_optimizer_with(optimizers[0])
    accumulate, plan = scenario.get("accumulate", 1), scenario.get("bag_plan")
    layouts = set()
    for step in range(STEPS):
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad()
            for k in range(accumulate):
                use_bag = _uses_bag(plan, rank, step, k, accumulate)
                micro = accumulate * step + k
                if k < accumulate - 1 and not (scenario.get("sync_first") and step == 0):
                    with model.no_sync():
                        _loss(model, micro, use_bag).backward()
                elif k == accumulate - 1:
                    _loss(model, micro, use_bag).backward()
            if not (overlap and model is ours):
                optimizer.step()
        what = f"rank {rank} step {step}"
        assert_same_tensors(_dense_grads(ours), _dense_grads(theirs), f"{what} grad", TOLERANCE, TOLERANCE)
        params = [dict(m.module.named_parameters()) for m in (ours, theirs)]
        assert_same_tensors(params[0], params[1], f"{what} param", TOLERANCE, TOLERANCE)
        layouts.update(
            str(p.grad.layout) for p in (ours.module.emb.weight, ours.module.bag.weight) if p.grad is not None
        )
    plan_sparse = [
        info.parameter_names
        for info in ours.bucket_plan()
        if info.parameter_names[0] in ("emb.weight", "bag.weight")
    ]
    moved = (ours.module.emb.weight - base.emb.weight).abs().max().item()
    stats = ours.comm_stats()
    summary = ours.take_comm_stats()
    path = default_path(ours)
    ours.close()
    return {
        "layouts": sorted(layouts),
        "sparse_buckets": plan_sparse,
        "moved": moved,
        "path": path,
        "bytes_to_hook": stats.bytes_to_hook if stats is not None else 0,
        "summary_steps": summary.steps if summary is not None else 0,
    }


def run_scenarios(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    return {name: side_by_side(rank, SCENARIOS[name]) for name in names}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    return run_distributed(run_scenarios, 2, sorted(SCENARIOS), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.processes
def test_sparse_gradients_like_torch(outcomes: list[dict[str, Any]], name: str) -> None:
    """Equality with torch after every step is asserted in the job; here: the gradients stayed sparse, each
    embedding had a bucket of its own, and the embedding trained."""
    for outcome in outcomes:
        result = outcome[name]
        assert result["layouts"] == ["torch.sparse_coo"]
        assert sorted(result["sparse_buckets"]) == [("bag.weight",), ("emb.weight",)]
        assert result["moved"] > 0
        assert result["bytes_to_hook"] > 0 and result["summary_steps"] > 0  # statistics count sparse buckets
    if name == "default":  # two CPU ranks: dense buckets through shared memory, sparse ones through gloo
        assert [outcome[name]["path"] for outcome in outcomes] == ["shared_memory"] * 2
    if name == "default_gloo":
        assert [outcome[name]["path"] for outcome in outcomes] == ["whole"] * 2


def run_three_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return side_by_side(rank, SCENARIOS["default"])


@pytest.mark.slow
@pytest.mark.processes
def test_three_ranks_like_torch() -> None:
    for outcome in run_distributed(run_three_ranks, 3, timeout=180):
        assert outcome["layouts"] == ["torch.sparse_coo"]


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "hook",
    [
        hooks.fp16_compress_hook,
        hooks.bf16_compress_hook,
        hooks.powersgd_hook,
        hooks.batched_powersgd_hook,
        hooks.fp16_compress_wrapper(hooks.allreduce_hook),
        default_hooks.fp16_compress_hook,
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
        powerSGD_hook.powerSGD_hook,
        powerSGD_hook.batched_powerSGD_hook,
    ],
)
def test_hooks_that_cannot_reduce_sparse_gradients_are_refused_at_registration(hook: Any) -> None:
    """torch's DDP fails inside backward (fp16: "cadd_sparse" not implemented for 'Half'; batched PowerSGD:
    resize_ on a sparse tensor) or, with PowerSGD, trains on doubled gradients; we refuse at once."""
    with one_rank_group():
        model = lightning_ddpx.DistributedDataParallel(Embedded())
        with pytest.raises(ValueError, match=r"cannot reduce sparse gradients") as raised:
            model.register_comm_hook(None, hook)
        assert "['emb.weight', 'bag.weight']" in str(raised.value)
        assert "sparse=False" in str(raised.value)
        model.close()


def test_hooks_are_accepted_without_sparse_gradients() -> None:
    with one_rank_group():
        model = lightning_ddpx.DistributedDataParallel(Embedded(sparse=False))
        model.register_comm_hook(None, hooks.fp16_compress_hook)
        model.close()


class FunctionalSparse(nn.Module):
    """A sparse gradient from ``F.embedding(sparse=True)`` on a plain parameter: not an embedding layer."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.fc = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(nn.functional.embedding(idx, self.table, sparse=True))


def test_an_unexpected_sparse_gradient_is_named() -> None:
    with one_rank_group():
        model = lightning_ddpx.DistributedDataParallel(FunctionalSparse())
        with pytest.raises(RuntimeError, match=r"parameter\(s\) \['table'\] received sparse gradients"):
            model(torch.tensor([1, 2])).sum().backward()
        model.close()


def test_a_hook_returning_a_dense_tensor_for_a_sparse_bucket_is_named() -> None:
    def densify(state: Any, bucket: Any) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(bucket.buffer().to_dense())
        return future

    with one_rank_group():
        model = lightning_ddpx.DistributedDataParallel(Embedded())
        model.register_comm_hook(None, densify)
        with pytest.raises(RuntimeError, match=r"holds the sparse gradient of parameter '(emb|bag)\.weight'"):
            _loss_one_rank(model)
        model.close()


def _loss_one_rank(model: nn.Module) -> None:
    idx, bag_idx = batch(0, 0)
    model(idx, bag_idx).sum().backward()


def test_a_sparse_bucket_shows_torchs_grad_bucket() -> None:
    """As in torch: buffer() is the sparse gradient itself, gradients() is empty, parameters() its one."""
    seen = []

    def spy(state: Any, bucket: Any) -> torch.futures.Future:
        seen.append((bucket.buffer().layout, len(bucket.gradients()), [p.shape for p in bucket.parameters()]))
        return hooks.allreduce_hook(None, bucket)

    with one_rank_group():
        model = lightning_ddpx.DistributedDataParallel(Embedded())
        model.register_comm_hook(None, spy)
        _loss_one_rank(model)
        model.close()
    sparse = [entry for entry in seen if entry[0] == torch.sparse_coo]
    assert sorted(sparse, key=str) == sorted(
        [(torch.sparse_coo, 0, [torch.Size([50, 8])]), (torch.sparse_coo, 0, [torch.Size([40, 8])])], key=str
    )


# ------------------------------------------------------------------------------------- bucket planning
@pytest.mark.parametrize("seed", range(20))
def test_sparse_parameters_get_their_own_bucket_as_in_torchs_planner(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    count = int(torch.randint(2, 20, (), generator=gen))
    numels = torch.randint(1, 200, (count,), generator=gen).tolist()
    sparse = (torch.rand(count, generator=gen) < 0.3).tolist()
    order = torch.randperm(count, generator=gen).tolist()
    first, cap = (int(x) * 4 for x in torch.randint(1, 400, (2,), generator=gen))
    f32, cpu = torch.float32, torch.device("cpu")
    ours = plan_buckets(numels, [f32] * count, [cpu] * count, order, first, cap, sparse=sparse)
    tensors = [torch.empty(numels[i]) for i in order]
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap], sparse, order)
    assert [b.param_indices for b in ours] == [tuple(b) for b in theirs]
    assert [b.sparse for b in ours] == [len(b) == 1 and sparse[b[0]] for b in theirs]


# ------------------------------------------------------------------------------------- uneven inputs
def run_join(rank: int, world_size: int, find_unused: bool) -> dict[str, torch.Tensor]:
    """Rank 1 runs out of batches first; the joined rank shadows the sparse buckets with empty gradients."""
    set_shared_memory(True)
    kwargs = {**SMALL_BUCKETS, "find_unused_parameters": find_unused}
    torch.manual_seed(0)
    base = Embedded()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    theirs = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), find_unused_parameters=find_unused, bucket_cap_mb=SMALL_BUCKETS["bucket_cap_mb"]
    )
    for model in (ours, theirs):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        with model.join():
            for step in range([5, 3][rank]):
                optimizer.zero_grad()
                _loss(model, step).backward()
                optimizer.step()
    params = [{n: p.detach().clone() for n, p in m.module.named_parameters()} for m in (ours, theirs)]
    assert_same_tensors(params[0], params[1], f"rank {rank} after join", TOLERANCE, TOLERANCE)
    ours.close()
    return params[0]


@pytest.mark.slow
@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.processes
def test_join_with_sparse_gradients_like_torch(find_unused: bool) -> None:
    results = run_distributed(run_join, 2, find_unused, timeout=120)
    assert_same_tensors(results[0], results[1], "replicas after join", 0, 0)


def sparse_on_one_rank(rank: int, world_size: int) -> str:
    model = lightning_ddpx.DistributedDataParallel(Embedded(sparse=rank == 0))
    try:
        _loss(model, 0).backward()  # compared when the reduction starts, before any bucket
    except ValueError as error:
        return str(error)
    finally:
        model.close()
    return "no error"


@pytest.mark.slow
@pytest.mark.processes
def test_a_sparse_flag_set_on_one_rank_only_is_named_before_the_first_reduction() -> None:
    """The bucket plans would differ (a hang or a collective mismatch); the settings check names it."""
    for message in run_distributed(sparse_on_one_rank, 2, timeout=120):
        assert "sparse gradients" in message and "emb.weight" in message, message


def unfrozen_sparse_embedding(rank: int, world_size: int) -> dict[str, Any]:
    """The sparse embedding frozen at wrapping and unfrozen after two steps (a fine-tuning schedule)."""
    torch.manual_seed(0)
    local = Embedded()
    local.emb.weight.requires_grad_(False)
    model = lightning_ddpx.DistributedDataParallel(copy.deepcopy(local), **SMALL_BUCKETS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = model.module.emb.weight.detach().clone()
    kinds = []
    for step in range(5):
        if step == 2:
            model.module.emb.weight.requires_grad_(True)
        optimizer.zero_grad()
        _loss(model, step).backward()
        grad = model.module.emb.weight.grad
        kinds.append(None if grad is None else grad.layout)
        optimizer.step()
        model.verify_replicas()  # bitwise equal on every rank, every step
    return {"moved": not torch.equal(start, model.module.emb.weight), "kinds": kinds}


@pytest.mark.slow
@pytest.mark.processes
def test_a_sparse_embedding_unfrozen_after_wrapping_is_averaged_sparse() -> None:
    for outcome in run_distributed(unfrozen_sparse_embedding, 2):
        assert outcome["moved"]
        assert outcome["kinds"] == [None, None, torch.sparse_coo, torch.sparse_coo, torch.sparse_coo]
