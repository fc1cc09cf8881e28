"""torch.compile with our DistributedDataParallel on 2 gloo ranks: compiled training equals eager training.

Each scenario trains an eager and a compiled copy of the same model from the same seed on the same
rank-dependent data and compares parameters after the steps (AOTAutograd may reorder float sums, hence a
tolerance rather than bit equality). Small bucket caps give several buckets, so the split is exercised.
Most cases use the ``aot_eager`` backend: it builds AOTAutograd's joint graph (the thing that makes every
gradient ready at once) without inductor's slow C++ compilation; one small case runs inductor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.processes

SMALL_BUCKETS = {"bucket_cap_mb": 0.02, "first_bucket_cap_mb": 0.005}  # ~5000 and ~1300 floats
STEPS = 6
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def deep_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )  # fmt: skip


def train(
    model: nn.Module, mode: str, backend: str, hook: str | None, steps: int = STEPS
) -> tuple[list[torch.Tensor], Any]:
    """Train ``model`` for ``steps`` SGD steps, in ``mode`` eager / torch_compile / split / whole.

    Returns the parameters and what was compiled (``compiled_graphs`` for the compile_model modes).
    """
    import lightning_ddpx
    from lightning_ddpx.hooks import build_comm_hook

    rank = dist.get_rank()
    ddp = lightning_ddpx.DistributedDataParallel(model, **SMALL_BUCKETS)
    if hook is not None:
        options = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2} if "powersgd" in hook else None
        ddp.register_comm_hook(*build_comm_hook(hook, process_group=ddp.process_group, powersgd=options))
    call = ddp
    if mode == "torch_compile":
        call = torch.compile(ddp, backend=backend)
    elif mode in ("split", "whole"):
        lightning_ddpx.compile_model(ddp, backend=backend, split=mode == "split")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=generator)
        optimizer.zero_grad()
        (call(x).pow(2).mean() * (rank + 1)).backward()
        optimizer.step()
        ddp.average_parameters_after_step()  # DiLoCo's outer step, post-local SGD's averaging; else nothing
    graphs = lightning_ddpx.compiled_graphs(ddp)
    ddp.close()
    return [p.detach().clone() for p in model.parameters()], graphs


def _compare_modes(rank: int, world_size: int, modes: list[str], backend: str, hook: str | None) -> dict:
    torch._dynamo.reset()
    results = {}
    for mode in ["eager", *modes]:
        torch.manual_seed(0)
        results[mode] = train(deep_mlp(), mode, backend, hook)
    eager, _ = results.pop("eager")
    return {
        mode: {"diff": max(float((a - b).abs().max()) for a, b in zip(eager, params)), "graphs": graphs}
        for mode, (params, graphs) in results.items()
    } | {"eager_norm": float(sum(p.norm() for p in eager))}


def _assert_matches_eager(per_rank: list[dict], modes: list[str]) -> None:
    for rank, result in enumerate(per_rank):
        for mode in modes:
            assert result[mode]["diff"] <= 1e-5, f"rank {rank}, {mode}: compiled differs from eager: {result}"


# ------------------------------------------------------------------------------------------------ tests
def test_compiled_allreduce_matches_eager_and_splits_at_buckets() -> None:
    modes = ["torch_compile", "split", "whole"]
    per_rank = run_distributed(_compare_modes, 2, modes, "aot_eager", None, timeout=240)
    _assert_matches_eager(per_rank, modes)
    for result in per_rank:
        (split,) = result["split"]["graphs"]
        assert split.pieces > 1, f"several buckets but one piece: {split}"
        launched = [b for piece in split.buckets for b in piece]
        assert sorted(launched) == list(range(len(launched))), f"every bucket completes in one piece: {split}"
        (whole,) = result["whole"]["graphs"]
        assert whole.pieces == 1


def _compare_hooks(rank: int, world_size: int, hooks: list[str]) -> dict:
    return {hook: _compare_modes(rank, world_size, ["split"], "aot_eager", hook)["split"] for hook in hooks}


def test_compiled_every_builtin_hook_matches_eager() -> None:
    """PowerSGD (error feedback, warm start) and every other built-in hook: split-compiled equals eager."""
    from lightning_ddpx.hooks import available_hooks

    hooks = [name for name in available_hooks() if name != "allreduce"]  # allreduce: the test above
    assert "powersgd" in hooks
    for rank, result in enumerate(run_distributed(_compare_hooks, 2, hooks, timeout=300)):
        for hook in hooks:
            assert result[hook]["diff"] <= 1e-5, f"rank {rank}, {hook}: compiled differs from eager: {result}"
            assert result[hook]["graphs"][0].pieces > 1, f"rank {rank}, {hook}: not split: {result[hook]}"


def _first_launch_sees(rank: int, world_size: int, split: bool) -> list[int]:
    """Per step: how many parameters of the first layer had a gradient when bucket 0 was launched."""
    import lightning_ddpx

    torch.manual_seed(0)
    model = deep_mlp()
    ddp = lightning_ddpx.DistributedDataParallel(model, **SMALL_BUCKETS)
    first_layer = list(model[0].parameters())
    seen: list[int] = []

    @lightning_ddpx.collectives_issued_on_call
    def recording_allreduce(state: None, bucket: Any) -> torch.futures.Future:
        if bucket.index() == 0:
            seen.append(sum(p.grad is not None for p in first_layer))
        buffer = bucket.buffer().div_(world_size)
        return dist.all_reduce(buffer, async_op=True).get_future()

    ddp.register_comm_hook(None, recording_allreduce)
    lightning_ddpx.compile_model(ddp, backend="aot_eager", split=split)
    for _ in range(4):
        ddp.zero_grad(set_to_none=True)
        ddp(torch.randn(8, 16)).sum().backward()
    ddp.close()
    return seen


def test_split_launches_first_bucket_before_earlier_layers_backward() -> None:
    """The point of the split: bucket 0 is reduced while the first layer's backward has not run yet."""
    per_rank = run_distributed(_first_launch_sees, 2, True, timeout=180)
    for seen in per_rank:
        assert seen[-2:] == [0, 0], f"the first layer's gradients existed before bucket 0 launched: {seen}"


def _lightning_fits(rank: int, world_size: int) -> dict:
    """Fit the same module eagerly and as ``torch.compile(module)``, in the same processes."""
    from lightning.pytorch import seed_everything

    from lightning_ddpx import DDPXStrategy
    from tests.strategy_helpers import TinyRegressor, make_trainer, parameters_of, quiet

    quiet()
    torch._dynamo.reset()

    class Deeper(TinyRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
            )

    results = {}
    for compiled in (False, True):
        seed_everything(0, verbose=False)
        module = Deeper()
        trainer = make_trainer(DDPXStrategy(bucket_cap_mb=0.01, first_bucket_cap_mb=0.002), max_steps=6)
        options = dict(backend="aot_eager", fullgraph=True, dynamic=False)
        trainer.fit(torch.compile(module, **options) if compiled else module)
        graphs = list(getattr(module.training_step, "graphs", []))
        carried = getattr(module.training_step, "compile_kwargs", None)
        results[compiled] = {"params": parameters_of(module), "graphs": graphs, "carried": carried}
    return results


def test_lightning_compiled_module_matches_eager_fit() -> None:
    """``Trainer.fit(torch.compile(module))`` with DDPXStrategy: same parameters, training_step split."""
    for rank, result in enumerate(run_distributed(_lightning_fits, 2, timeout=240, init_process_group=False)):
        eager, compiled = result[False], result[True]
        for name, value in eager["params"].items():
            torch.testing.assert_close(
                compiled["params"][name], value, **TOLERANCE, msg=f"rank {rank}: {name}"
            )
        graphs = compiled["graphs"]
        assert graphs and max(g.pieces for g in graphs) > 1, (
            f"rank {rank}: the strategy did not split: {graphs}"
        )
        assert compiled["carried"] == {"fullgraph": True, "dynamic": False}  # the user's options survive


@pytest.mark.slow
def test_inductor_split_matches_eager() -> None:
    """One small inductor case (C++ compilation is slow on 2 cores): the split pieces' strides and lazily
    compiled backwards must line up."""
    modes = ["split"]
    per_rank = run_distributed(_compare_inductor, 2, timeout=420)
    _assert_matches_eager(per_rank, modes)


def _compare_inductor(rank: int, world_size: int) -> dict:
    torch._dynamo.reset()
    results = {}
    for mode in ("eager", "split"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        results[mode] = train(model, mode, "inductor", None, steps=3)
    (eager, _), (split, graphs) = results["eager"], results["split"]
    assert graphs[0].pieces > 1, graphs
    return {
        "split": {"diff": max(float((a - b).abs().max()) for a, b in zip(eager, split)), "graphs": graphs}
    }
