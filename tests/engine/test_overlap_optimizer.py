"""``overlap_optimizer_with``: the optimizer steps bucket by bucket inside backward, against torch's DDP +
the same optimizer stepped after backward.

One 2-rank gloo job runs every scenario (process start-up is paid once); each test reads one scenario's
outcome. Models get rank-dependent batches (an unreduced gradient cannot pass), small bucket caps force
several buckets, and after every step the parameters AND the optimizer state must equal torch's within
1e-6. Every scenario also records that the parameters moved, so a run that never steps cannot pass.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lightning_ddpx
from lightning_ddpx.engine.optim.overlap import check_overlappable
from tests.dist_utils import run_distributed
from tests.oracle import Branches, rank_batch

SMALL_BUCKETS = {
    "bucket_cap_mb": 0.001,
    "first_bucket_cap_mb": 0.0002,
}  # ~262 and ~52 floats: 3 buckets of mlp()
# The overlap's last bucket becomes [fc1.weight, scale] of ScaledInput; fc1.weight and fc2.weight (20,480
# elements, bucket 0) are longer than a slice (the first cap's 2621 floats, rounded up to 1024) and are
# updated slice by slice; scale is whole.
SLICED_BUCKETS = {"first_bucket_cap_mb": 0.01, "bucket_cap_mb": 1.0}
STEPS = 6
TOLERANCE = 1e-6


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


WIDE_BRANCHES = functools.partial(Branches, hidden=64, out=8)


class ScaledInput(nn.Module):
    """A small first parameter and a large first layer: the last bucket mixes a cut and a whole parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.fc1 = nn.Linear(16, 640)
        self.fc2 = nn.Linear(640, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x * self.scale)))))


def loss_of(model: nn.Module, micro: int) -> torch.Tensor:
    rank = dist.get_rank()
    return model(rank_batch(rank, micro, (8, 16))).pow(2).mean() * (rank + 1)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def adamw_two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """Weight decay on matrices only: the per-bucket views must keep each group's options."""
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 3e-3},
        ],
        lr=1e-2,
    )


def max_state_diff(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> float:
    a, b = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert a.keys() == b.keys(), f"optimizer state for parameters {sorted(a)} vs torch's {sorted(b)}"
    worst = 0.0
    for index in a:
        assert a[index].keys() == b[index].keys()
        for key, value in a[index].items():
            other = b[index][key]
            if isinstance(value, torch.Tensor):
                worst = max(worst, (value.double() - other.double()).abs().max().item())
            else:
                assert value == other, f"state[{index}][{key!r}]: {value} vs {other}"
    return worst


def max_param_diff(ours: nn.Module, theirs: nn.Module) -> float:
    return max(
        (a.double() - b.double()).abs().max().item()
        for a, b in zip(ours.module.parameters(), theirs.module.parameters())
    )


def side_by_side(
    build: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    ours_kwargs: dict[str, Any],
    torch_kwargs: dict[str, Any] | None = None,
    accumulate: int = 1,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    reload_state_at: int | None = None,
    fp16_hooks: bool = False,
    debug: bool = False,
) -> dict[str, Any]:
    """Train ours (overlapped) and torch's (plain step) side by side; the worst differences seen.
    ``fp16_hooks``: our fp16 hook on ours, torch's on theirs; ``debug``: ours built under DDPX_DEBUG=1."""
    torch.manual_seed(0)
    base = build()
    if debug:
        os.environ["DDPX_DEBUG"] = "1"
    try:
        ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **ours_kwargs)
    finally:
        os.environ.pop("DDPX_DEBUG", None)
    if torch_kwargs is None:  # torch has no first_bucket_cap_mb (its first bucket is fixed at 1 MiB)
        torch_kwargs = {k: v for k, v in ours_kwargs.items() if k != "first_bucket_cap_mb"}
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **torch_kwargs)
    if fp16_hooks:
        ours.register_comm_hook(None, lightning_ddpx.hooks.fp16_compress_hook)
        theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt_ours, opt_theirs = make_optimizer(ours.module), make_optimizer(theirs.module)
    ours.overlap_optimizer_with(opt_ours)
    schedulers = [scheduler(o) for o in (opt_ours, opt_theirs)] if scheduler else []
    start = [p.detach().clone() for p in ours.module.parameters()]
    out: dict[str, Any] = {"param": 0.0, "state": 0.0, "moved_during_no_sync": 0.0, "buckets": 0, "sliced": 0}
    micro = 0
    for step in range(STEPS):
        if step == reload_state_at:  # load_state_dict replaces the optimizer's state dict object
            opt_ours.load_state_dict(copy.deepcopy(opt_ours.state_dict()))
        for model, optimizer in ((ours, opt_ours), (theirs, opt_theirs)):
            optimizer.zero_grad()
            for k in range(accumulate):
                if k < accumulate - 1:
                    before = [p.detach().clone() for p in model.parameters()]
                    with model.no_sync():
                        loss_of(model, micro + k).backward()
                    moved = max((a - p).abs().max().item() for a, p in zip(before, model.parameters()))
                    out["moved_during_no_sync"] = max(out["moved_during_no_sync"], moved)
                else:
                    loss_of(model, micro + k).backward()
            if model is theirs:
                optimizer.step()
            else:
                assert ours.optimizer_stepped_in_backward
        for s in schedulers:
            s.step()
        micro += accumulate
        out["param"] = max(out["param"], max_param_diff(ours, theirs))
        out["state"] = max(out["state"], max_state_diff(opt_ours, opt_theirs))
        out["buckets"] = max(out["buckets"], len(ours.bucket_plan()))
        overlap = ours.reducer.overlap
        out["sliced"] = max(out["sliced"], overlap.last_sliced_params if overlap is not None else 0)
    out["debug"] = ours.reducer.progress.debug
    out["moved"] = max((a - p).abs().max().item() for a, p in zip(start, ours.module.parameters()))
    out["lr"] = [g["lr"] for g in opt_ours.param_groups]
    out["has_state"] = len(opt_ours.state) > 0
    ours.close()
    return out


def joined_on_uneven_inputs() -> dict[str, Any]:
    """join() with long parameters updated in slices: rank 1 runs out after 3 of 6 steps and shadows the rest,
    so its shadow collectives must be the active rank's buckets. Ours (overlap) vs torch's DDP join (plain step)."""
    torch.manual_seed(0)
    base = ScaledInput()
    ours = lightning_ddpx.DistributedDataParallel(copy.deepcopy(base), **SLICED_BUCKETS)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1.0)
    opt_ours, opt_theirs = adamw_two_groups(ours.module), adamw_two_groups(theirs.module)
    ours.overlap_optimizer_with(opt_ours)
    start = [p.detach().clone() for p in ours.module.parameters()]
    sliced = 0
    steps = 6 if dist.get_rank() == 0 else 3
    for model, optimizer in ((ours, opt_ours), (theirs, opt_theirs)):
        with model.join():
            for step in range(steps):
                optimizer.zero_grad()
                loss_of(model, step).backward()
                if model is theirs:
                    optimizer.step()
                else:
                    sliced = max(sliced, ours.reducer.overlap.last_sliced_params)
    out = {
        "param": max_param_diff(ours, theirs),
        "state": max_state_diff(opt_ours, opt_theirs),
        "buckets": len(ours.bucket_plan()),
        "sliced": sliced,
        "moved": max((a - p).abs().max().item() for a, p in zip(start, ours.module.parameters())),
        "has_state": len(opt_ours.state) > 0,
    }
    ours.close()
    return out


class OwnStep(torch.optim.SGD):
    """A subclass that overrides step(): it may do anything across parameters, so it is refused."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


def refusals() -> dict[str, str]:
    """Each refusal's message ('' when nothing was raised)."""
    model = lightning_ddpx.DistributedDataParallel(mlp(), **SMALL_BUCKETS)
    out = {}
    for name, make in (
        ("lbfgs", lambda: torch.optim.LBFGS(model.parameters())),
        ("own_step", lambda: OwnStep(model.parameters(), lr=0.1)),
        ("foreign", lambda: torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(3))], lr=0.1)),
    ):
        try:
            model.overlap_optimizer_with(make())
            out[name] = ""
        except (TypeError, ValueError) as error:
            out[name] = str(error)
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked.register_step_post_hook(lambda *args: None)
    try:
        model.overlap_optimizer_with(hooked)
        out["hooks"] = ""
    except ValueError as error:
        out["hooks"] = str(error)
    # A second step() after an overlapped backward would apply the update twice: refused.
    optimizer = sgd(model.parameters())
    model.overlap_optimizer_with(optimizer)
    loss_of(model, 0).backward()
    try:
        optimizer.step()
        out["second_step"] = ""
    except RuntimeError as error:
        out["second_step"] = str(error)
    # After a backward inside no_sync() nothing stepped: a (local) step() is the user's to make.
    with model.no_sync():
        loss_of(model, 1).backward()
    optimizer.step()
    out["step_after_no_sync"] = "ok"
    # None switches back to the plain step.
    model.overlap_optimizer_with(None)
    loss_of(model, 2).backward()
    optimizer.step()
    out["plain_again"] = "ok"
    model.close()
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "sgd_momentum_wd": lambda: side_by_side(mlp, lambda m: sgd(m.parameters()), SMALL_BUCKETS),
    "adamw_groups_scheduler": lambda: side_by_side(
        mlp, adamw_two_groups, SMALL_BUCKETS,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    ),
    "as_bucket_view": lambda: side_by_side(
        mlp, adamw_two_groups, {**SMALL_BUCKETS, "gradient_as_bucket_view": True}
    ),
    "accumulate_no_sync": lambda: side_by_side(mlp, lambda m: sgd(m.parameters()), SMALL_BUCKETS, accumulate=3),
    "find_unused": lambda: side_by_side(
        WIDE_BRANCHES, lambda m: sgd(m.parameters()), {**SMALL_BUCKETS, "find_unused_parameters": True}
    ),
    "find_unused_adamw": lambda: side_by_side(
        WIDE_BRANCHES, adamw_two_groups, {**SMALL_BUCKETS, "find_unused_parameters": True}
    ),
    "static_graph": lambda: side_by_side(mlp, adamw_two_groups, {**SMALL_BUCKETS, "static_graph": True}),
    "state_reloaded": lambda: side_by_side(mlp, adamw_two_groups, SMALL_BUCKETS, reload_state_at=3),
    # long parameters stepped slice by slice (engine.piecewise_step), the last bucket's included
    "sliced_sgd": lambda: side_by_side(ScaledInput, lambda m: sgd(m.parameters()), SLICED_BUCKETS),
    "sliced_adamw_groups_scheduler": lambda: side_by_side(
        ScaledInput, adamw_two_groups, SLICED_BUCKETS,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    ),
    "sliced_as_bucket_view": lambda: side_by_side(
        ScaledInput, adamw_two_groups, {**SLICED_BUCKETS, "gradient_as_bucket_view": True}
    ),
    "sliced_state_reloaded": lambda: side_by_side(
        ScaledInput, adamw_two_groups, SLICED_BUCKETS, reload_state_at=3
    ),
    "sliced_accumulate_no_sync": lambda: side_by_side(
        ScaledInput, lambda m: sgd(m.parameters()), SLICED_BUCKETS, accumulate=3
    ),
    "sliced_scale_not_optimized": lambda: side_by_side(
        ScaledInput, lambda m: sgd(p for n, p in m.named_parameters() if n != "scale"), SLICED_BUCKETS
    ),
    "sliced_join_uneven": joined_on_uneven_inputs,
    "sliced_debug": lambda: side_by_side(ScaledInput, adamw_two_groups, SLICED_BUCKETS, debug=True),
    # a registered hook: long parameters are updated in slices just the same
    "sliced_fp16_hook": lambda: side_by_side(ScaledInput, adamw_two_groups, SLICED_BUCKETS, fp16_hooks=True),
    "sliced_static_graph": lambda: side_by_side(
        ScaledInput, adamw_two_groups, {**SLICED_BUCKETS, "static_graph": True}
    ),
    "sliced_find_unused": lambda: side_by_side(
        ScaledInput, adamw_two_groups, {**SLICED_BUCKETS, "find_unused_parameters": True}
    ),
    # Adafactor's factored statistics are not elementwise: long parameters step whole
    "sliced_adafactor_whole": lambda: side_by_side(
        ScaledInput, lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2), SLICED_BUCKETS
    ),
}  # fmt: skip


def run_all(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = scenario()
        except AssertionError as error:  # a local check failed: report it in that scenario's test
            results[name] = {"error": str(error)}
    results["refusals"] = refusals()
    return results


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    return run_distributed(run_all, 2, timeout=300)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.processes
def test_same_parameters_and_state_as_torch_ddp(outcomes: list[dict[str, Any]], name: str) -> None:
    for rank, outcome in enumerate(outcomes):
        result = outcome[name]
        assert "error" not in result, f"rank {rank} {name}: {result.get('error')}"
        assert result["buckets"] >= 3, f"rank {rank}: the scenario must use several buckets"
        assert result["moved"] > 1e-3, f"rank {rank}: parameters did not move, nothing was stepped"
        assert result["has_state"], f"rank {rank}: the optimizer state stayed empty"
        assert result["param"] <= TOLERANCE, f"rank {rank} {name}: parameters differ by {result['param']}"
        assert result["state"] <= TOLERANCE, (
            f"rank {rank} {name}: optimizer state differs by {result['state']}"
        )
        if name.startswith("sliced_"):
            # fc1.weight (the last bucket) and fc2.weight (bucket 0) in cache-sized slices on the CPU; never in
            # a first step (no state yet), never with Adafactor (not elementwise)
            expected = 0 if name.endswith("_whole") else 2
            assert result["sliced"] == expected, f"rank {rank} {name}: {result['sliced']} parameter(s) sliced"
        else:
            assert result["sliced"] == 0, f"rank {rank} {name}: no parameter is longer than a slice"
        if name.endswith("_debug"):
            assert result["debug"], f"rank {rank}: DDPX_DEBUG was not on"


@pytest.mark.processes
def test_no_step_inside_no_sync(outcomes: list[dict[str, Any]]) -> None:
    for outcome in outcomes:
        assert outcome["accumulate_no_sync"]["moved_during_no_sync"] == 0.0


@pytest.mark.processes
def test_scheduler_changes_lr_of_the_steps(outcomes: list[dict[str, Any]]) -> None:
    # StepLR halves every 2 steps: after 6 steps lr is 1e-2 / 8 (and 3e-3 / 8), equal to torch's run above
    lrs = outcomes[0]["adamw_groups_scheduler"]["lr"]
    assert lrs == pytest.approx([1e-2 / 8, 3e-3 / 8])


@pytest.mark.parametrize(
    "case, must_say",
    [
        ("lbfgs", ("LBFGS", "closure", "overlap_optimizer=False")),
        ("own_step", ("OwnStep", "overrides step()", "Supported: SGD")),
        ("foreign", ("1 trainable parameter(s)", "does not reduce")),
        ("hooks", ("step pre/post hooks", "Remove the hooks")),
        ("second_step", ("already stepped it", "apply the update twice", "overlap_optimizer_with(None)")),
    ],
)
@pytest.mark.processes
def test_refused_with_the_reason(
    outcomes: list[dict[str, Any]], case: str, must_say: tuple[str, ...]
) -> None:
    message = outcomes[0]["refusals"][case]
    assert message, f"{case} was not refused"
    for part in must_say:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.processes
def test_plain_steps_remain_possible(outcomes: list[dict[str, Any]]) -> None:
    refusals = outcomes[1]["refusals"]
    assert refusals["step_after_no_sync"] == "ok" and refusals["plain_again"] == "ok"


def test_check_overlappable_accepts_torch_per_parameter_optimizers() -> None:
    params = [nn.Parameter(torch.ones(2))]
    for cls in (
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.RMSprop,
        torch.optim.Adagrad,
    ):
        check_overlappable(cls(params, lr=0.1), params, ["w"])
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer"):
        check_overlappable(object(), params, ["w"])


def plans_with_overlap(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    # first bucket ~52 floats: mlp()'s last layer; then one bucket for the rest (torch's layout)
    model = lightning_ddpx.DistributedDataParallel(mlp(), first_bucket_cap_mb=0.0002, bucket_cap_mb=100.0)
    names = lambda: [list(b.parameter_names) for b in model.bucket_plan()]  # noqa: E731
    before = names()
    model.overlap_optimizer_with(sgd(model.parameters()))
    with_overlap = names()
    model.overlap_optimizer_with(None)
    after = names()
    # one rank overlapping, the other not: the buckets differ, so the first reduction must refuse by name
    mismatched = lightning_ddpx.DistributedDataParallel(mlp())
    if rank == 0:
        mismatched.overlap_optimizer_with(sgd(mismatched.parameters()))
    try:
        mismatched(rank_batch(rank, 0, (8, 16))).sum().backward()
        error = None
    except ValueError as caught:
        error = str(caught)
    return {"before": before, "with_overlap": with_overlap, "after": after, "error": error}


@pytest.mark.processes
def test_the_overlap_keeps_its_last_bucket_small_and_every_rank_must_agree() -> None:
    """The last bucket's update is the one no communication can hide, so with the overlap the planner
    splits that bucket down to its trailing parameters (the first bucket's cap); switching the overlap off
    restores torch's layout. The layout then depends on the option, so the settings check compares it."""
    for rank, result in enumerate(run_distributed(plans_with_overlap, 2, timeout=120)):
        # torch's construction-time layout: one bucket, in parameter order
        assert result["before"] == [["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]]
        assert result["with_overlap"] == [
            ["4.bias", "4.weight"],
            ["2.bias", "2.weight", "0.bias"],
            ["0.weight"],
        ]
        assert result["after"] == result["before"]
        assert result["error"] is not None and "overlap_optimizer" in result["error"], (rank, result["error"])
