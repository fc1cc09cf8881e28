"""``overlap_optimizer=True`` through the Trainer and Fabric, against ``strategy="ddp"`` / torch's DDP.

ONE 2-process job runs every fit (process start-up paid once); each test checks one outcome. Small bucket
caps give several buckets. Parameters and optimizer state must equal the reference within 1e-6, and the
refusals must name the option and why.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from tests.dist_utils import run_distributed
from tests.strategy_helpers import TinyRegressor, fit, parameters_of, quiet

pytestmark = pytest.mark.slow

SMALL_BUCKETS = {"first_bucket_cap_mb": 100 / 2**20, "bucket_cap_mb": 200 / 2**20}  # 25 and 50 floats
STEPS = 4
ACCUMULATE = 3
GAMMA = 0.8


class AdamWScheduled(TinyRegressor):
    """AdamW with weight decay and a StepLR multiplying the learning rate by GAMMA every step."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WideAdamW(AdamWScheduled):
    """8 -> 512 -> 4: with SMALL_BUCKETS the overlap updates net.0.weight (4,096 elements, its last bucket)
    and net.2.weight (2,048) slice by slice (engine.piecewise_step)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 4))


class SliceProbe(Callback):
    """After each overlapped backward: how many parameters were updated in slices."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.seen.append(trainer.strategy.model.reducer.overlap.last_sliced_params)


class Manual(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        self.optimizers().step()


class OwnClipping(TinyRegressor):
    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any
    ) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)


class OverlapProbe(Callback):
    """Records, at each on_before_optimizer_step (after the closure's backward), whether that backward
    already stepped Lightning's optimizer bucket by bucket: a run that silently fell back to the plain
    step would match ddp too."""

    def __init__(self) -> None:
        self.stepped: list[bool] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        model = trainer.strategy.model
        self.stepped.append(
            getattr(model, "overlapped_optimizer", None) is trainer.optimizers[0]
            and model.optimizer_stepped_in_backward
        )


def optimizer_state(trainer: Any) -> dict[int, dict[str, torch.Tensor]]:
    return {
        i: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
        for i, s in trainer.optimizers[0].state_dict()["state"].items()
    }


def ddpx(**options: Any) -> Any:
    from lightning_ddpx import DDPXStrategy

    return DDPXStrategy(overlap_optimizer=True, **SMALL_BUCKETS, **options)


def refusal(model_cls: type, **trainer_kwargs: Any) -> str:
    try:
        fit(ddpx(), max_steps=1, model_cls=model_cls, **trainer_kwargs)
    except ValueError as error:
        return str(error)
    return ""


def fabric_loop(rank: int, overlap: bool) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy

    strategy = DDPXStrategy(timeout=timedelta(seconds=60), overlap_optimizer=overlap, **SMALL_BUCKETS)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=0.02, weight_decay=0.1))
    generator = torch.Generator().manual_seed(100 + rank)
    stepped: list[bool] = []
    for i in range(2 * ACCUMULATE):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        steps_now = (i + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not steps_now) if not steps_now else nullcontext():
            fabric.backward(nn.functional.mse_loss(model(x), y))
        stepped.append(model._forward_module.optimizer_stepped_in_backward)
        if steps_now:
            optimizer.step()  # unchanged loop: does nothing after an overlapped backward
            optimizer.zero_grad()
    out = {"params": parameters_of(model.module), "buckets": len(model._forward_module.bucket_plan())}
    out["stepped"] = stepped
    if overlap:
        try:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            out["clip"] = ""
        except ValueError as error:
            out["clip"] = str(error)
    return out


def train_everything(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    quiet()
    from lightning.pytorch import seed_everything

    out: dict[str, Any] = {}
    seed_everything(0, verbose=False)
    out["start"] = parameters_of(AdamWScheduled())  # what fit() starts from
    # AdamW + weight decay + LR scheduler: ddp vs ddpx with overlap.
    for name, strategy in (("ddp", "ddp"), ("overlap", ddpx())):
        probe = OverlapProbe()
        trainer, model = fit(strategy, max_steps=STEPS, model_cls=AdamWScheduled, callbacks=[probe])
        out[f"adamw/{name}/stepped"] = probe.stepped
        out[f"adamw/{name}"] = parameters_of(model)
        out[f"adamw/{name}/state"] = optimizer_state(trainer)
        out[f"adamw/{name}/lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        out[f"adamw/{name}/steps"] = trainer.global_step
    # A wider model: the last bucket in chunks, long parameters in slices, through the Trainer.
    for name, strategy in (("ddp", "ddp"), ("overlap", ddpx())):
        probes = [SliceProbe()] if name == "overlap" else []
        trainer, model = fit(strategy, max_steps=STEPS, model_cls=WideAdamW, callbacks=probes)
        out[f"wide/{name}"] = parameters_of(model)
        out[f"wide/{name}/state"] = optimizer_state(trainer)
        if probes:
            out["wide/seen"] = probes[0].seen
    # SGD with momentum, accumulate_grad_batches: the step happens on the boundary only.
    for name, strategy in (("ddp", "ddp"), ("overlap", ddpx())):
        probe = OverlapProbe()
        trainer, model = fit(strategy, max_steps=2, accumulate_grad_batches=ACCUMULATE, callbacks=[probe])
        out[f"accumulate/{name}/stepped"] = probe.stepped
        out[f"accumulate/{name}"] = parameters_of(model)
        out[f"accumulate/{name}/state"] = optimizer_state(trainer)
        out[f"accumulate/{name}/steps"] = trainer.global_step
    # Resume: 1 epoch, checkpoint, 1 more == 2 epochs of ddp (optimizer state restored by load_state_dict).
    path = os.path.join(ckpt_dir, "epoch1.ckpt")
    trainer, _ = fit(ddpx(), max_steps=-1, max_epochs=1, model_cls=AdamWScheduled)
    trainer.save_checkpoint(path)
    trainer, model = fit(ddpx(), max_steps=-1, max_epochs=2, model_cls=AdamWScheduled, ckpt_path=path)
    out["resume/overlap"] = parameters_of(model)
    out["resume/overlap/state"] = optimizer_state(trainer)
    out["resume/overlap/steps"] = trainer.global_step
    trainer, model = fit("ddp", max_steps=-1, max_epochs=2, model_cls=AdamWScheduled)
    out["resume/ddp"] = parameters_of(model)
    out["resume/ddp/state"] = optimizer_state(trainer)
    # Fabric: an unchanged loop with optimizer.step() after each synchronised backward.
    for overlap in (False, True):
        out[f"fabric/{overlap}"] = fabric_loop(rank, overlap)
    # Refusals at setup.
    out["refuse/clip"] = refusal(TinyRegressor, gradient_clip_val=1.0)
    out["refuse/own_clipping"] = refusal(OwnClipping)
    out["refuse/manual"] = refusal(Manual)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt_dir = str(tmp_path_factory.mktemp("overlap_ckpt"))
    return run_distributed(
        train_everything, 2, ckpt_dir, init_process_group=False, timeout=400, pg_timeout=120
    )


def assert_same(actual: dict, expected: dict, tolerance: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], rtol=tolerance, atol=tolerance, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.processes
def test_adamw_with_scheduler_matches_ddp(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert out["adamw/overlap/steps"] == out["adamw/ddp/steps"] == STEPS
        assert out["adamw/overlap/stepped"] == [True] * STEPS and out["adamw/ddp/stepped"] == [False] * STEPS
        assert_same(out["adamw/overlap"], out["adamw/ddp"])
        for index, state in out["adamw/ddp/state"].items():
            assert_same(out["adamw/overlap/state"][index], state)
        assert out["adamw/overlap/lr"] == out["adamw/ddp/lr"] == pytest.approx(0.02 * GAMMA**STEPS)
        assert all(not torch.equal(out["adamw/overlap"][k], v) for k, v in out["start"].items())


@pytest.mark.processes
def test_sliced_updates_match_ddp(results: list[dict[str, Any]]) -> None:
    for out in results:
        # the first step creates AdamW's state, so it is whole; from the second on, both weights in slices
        assert out["wide/seen"] == [0] + [2] * (STEPS - 1)
        assert_same(out["wide/overlap"], out["wide/ddp"])
        for index, state in out["wide/ddp/state"].items():
            assert_same(out["wide/overlap/state"][index], state)


@pytest.mark.processes
def test_accumulation_steps_on_the_boundary_like_ddp(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert out["accumulate/overlap/steps"] == out["accumulate/ddp/steps"] == 2
        assert out["accumulate/overlap/stepped"] == [True, True]  # once per boundary, never in between
        assert_same(out["accumulate/overlap"], out["accumulate/ddp"])
        for index, state in out["accumulate/ddp/state"].items():
            assert_same(out["accumulate/overlap/state"][index], state)


@pytest.mark.processes
def test_resume_keeps_optimizer_state(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert out["resume/overlap/steps"] == 16
        assert_same(out["resume/overlap"], out["resume/ddp"])
        for index, state in out["resume/ddp/state"].items():
            assert_same(out["resume/overlap/state"][index], state)


@pytest.mark.processes
def test_fabric_loop_unchanged_matches_plain_step(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert out["fabric/True"]["buckets"] >= 2
        assert out["fabric/True"]["stepped"] == [False, False, True] * 2  # on the synchronised backwards only
        assert out["fabric/False"]["stepped"] == [False] * 6
        assert_same(out["fabric/True"]["params"], out["fabric/False"]["params"])


@pytest.mark.parametrize(
    "key, must_say",
    [
        ("refuse/clip", ("overlap_optimizer=True", "gradient_clip_val=1.0", "needs every gradient")),
        ("refuse/own_clipping", ("OwnClipping.configure_gradient_clipping", "Remove the override")),
        ("refuse/manual", ("automatic optimization", "overlap_optimizer=False")),
    ],
)
@pytest.mark.processes
def test_trainer_refusals(results: list[dict[str, Any]], key: str, must_say: tuple[str, ...]) -> None:
    for out in results:
        assert out[key], f"{key}: nothing was refused"
        for part in must_say:
            assert part in out[key], f"{part!r} not in {out[key]!r}"


@pytest.mark.processes
def test_fabric_clipping_refused(results: list[dict[str, Any]]) -> None:
    message = results[0]["fabric/True"]["clip"]
    assert "fabric.clip_gradients(max_norm=...)" in message and "overlap_optimizer=True" in message


def test_option_is_checked_at_construction() -> None:
    from lightning_ddpx import DDPXStrategy  # registers the strategies before config is imported alone
    from lightning_ddpx.lightning.settings.config import DDPXConfig

    assert DDPXStrategy(overlap_optimizer=True).overlap_optimizer
    with pytest.raises(TypeError, match="overlap_optimizer must be True or False"):
        DDPXConfig(overlap_optimizer="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be combined with post-local SGD"):
        DDPXConfig(
            overlap_optimizer=True,
            comm_hook="post_local_sgd",
            post_local_sgd={"start_localSGD_iter": 2, "period": 2},
        )
    assert DDPXConfig(overlap_optimizer=True).overlap_optimizer
