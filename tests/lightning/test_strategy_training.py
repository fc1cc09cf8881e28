"""DDPXStrategy trains like Lightning's DDPStrategy: same results, one sync per optimizer step, manual loops.

All Lightning runs of this module happen in ONE 2-process job (module fixture) to pay for process start-up
once; each test then checks one property of its results. Every comparison is against ``strategy="ddp"``
(torch's DDP under Lightning) on the same seeds and the same rank-dependent data.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.strategy_helpers import (
    BranchUnusedOnRank1,
    CollectiveCounter,
    ManualAccumulate,
    ManualTwoOptimizers,
    TinyRegressor,
    counting_allreduce_hook,
    fit,
    parameters_of,
    quiet,
)

pytestmark = [pytest.mark.slow, pytest.mark.processes]

ACCUMULATE = 3
STEPS = 4


def train_everything(rank: int, world_size: int) -> dict:
    quiet()
    from lightning_ddpx import DDPXStrategy, DistributedDataParallel

    out: dict = {}
    # Drop-in: the same unmodified module with "ddp" and "ddpx".
    for name in ("ddp", "ddpx"):
        trainer, model = fit(name, max_steps=STEPS)
        out[f"dropin/{name}"] = parameters_of(model)
        if name == "ddpx":
            out["dropin/ddpx_strategy"] = type(trainer.strategy).__name__
            out["dropin/unwrapped_after_fit"] = trainer.strategy.model is model
            out["dropin/lightning_module_is_model"] = trainer.strategy.lightning_module is model

    # Gradient accumulation: results equal to ddp; collectives only on the micro-batch that steps.
    for name in ("ddp", "ddpx"):
        counter = CollectiveCounter()
        _, model = fit(name, max_steps=2, accumulate_grad_batches=ACCUMULATE, callbacks=[counter])
        out[f"accumulate/{name}"] = parameters_of(model)
        out[f"accumulate/{name}/allreduce_per_batch"] = counter.per_batch
    state = {"buckets": 0, "syncs": 0}
    strategy = DDPXStrategy(comm_hook=counting_allreduce_hook, comm_state=state)
    trainer, model = fit(strategy, max_steps=2, accumulate_grad_batches=ACCUMULATE)
    out["accumulate/counting_hook"] = dict(state)
    out["accumulate/counting_hook/params"] = parameters_of(model)
    out["accumulate/optimizer_steps"] = trainer.global_step

    # The wrapper seen during training is ours, and Lightning's forward redirection reaches training_step.
    seen: dict = {}

    class Probe(TinyRegressor):
        def training_step(self, batch, batch_idx):
            seen["wrapper"] = type(self.trainer.strategy.model).__name__
            seen["is_ours"] = isinstance(self.trainer.strategy.model, DistributedDataParallel)
            return super().training_step(batch, batch_idx)

    fit("ddpx", max_steps=1, model_cls=Probe)
    out["wrapper"] = seen

    # Manual optimisation: two optimizers with toggle_optimizer (needs find_unused_parameters, as with ddp).
    for name in ("ddp_find_unused_parameters_true", "ddpx_find_unused_parameters_true"):
        _, model = fit(name, max_steps=2 * STEPS, model_cls=ManualTwoOptimizers)
        out[f"manual_two/{name}"] = parameters_of(model)
    # Manual optimisation with accumulation through optimizer.toggle_model(sync_grad=...).
    for name in ("ddp", "ddpx"):
        counter = CollectiveCounter()
        _, model = fit(name, max_steps=STEPS // 2, model_cls=ManualAccumulate, callbacks=[counter])
        out[f"manual_acc/{name}"] = parameters_of(model)
        out[f"manual_acc/{name}/allreduce_per_batch"] = counter.per_batch

    # A parameter used on rank 0 only trains with find_unused_parameters, like ddp.
    for name in ("ddp_find_unused_parameters_true", "ddpx_find_unused_parameters_true"):
        _, model = fit(name, max_steps=STEPS, model_cls=BranchUnusedOnRank1)
        out[f"unused/{name}"] = parameters_of(model)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(train_everything, 2, init_process_group=False, timeout=300, pg_timeout=120)


def assert_same(actual: dict, expected: dict, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_drop_in_replacement_matches_ddp(results):
    for rank_result in results:
        assert rank_result["dropin/ddpx_strategy"] == "DDPXStrategy"
        assert_same(rank_result["dropin/ddpx"], rank_result["dropin/ddp"])
        assert rank_result["dropin/unwrapped_after_fit"] and rank_result["dropin/lightning_module_is_model"]
    assert_same(results[1]["dropin/ddpx"], results[0]["dropin/ddpx"], rtol=0, atol=0)  # ranks agree exactly


def test_training_step_runs_inside_our_wrapper(results):
    assert results[0]["wrapper"] == {"wrapper": "DistributedDataParallel", "is_ours": True}


def test_accumulation_matches_ddp(results):
    for rank_result in results:
        assert_same(rank_result["accumulate/ddpx"], rank_result["accumulate/ddp"])
        assert_same(rank_result["accumulate/counting_hook/params"], rank_result["accumulate/ddp"])


def test_accumulation_synchronises_once_per_optimizer_step(results):
    for rank_result in results:
        steps = rank_result["accumulate/optimizer_steps"]
        assert steps == 2
        # The counting hook runs on CPU (Lightning's DDPStrategy would ignore it there): once per step.
        assert rank_result["accumulate/counting_hook"] == {"buckets": steps, "syncs": steps}
        # Collectives per micro-batch: none while accumulating, one allreduce (one bucket) on the last.
        expected = ([0] * (ACCUMULATE - 1) + [1]) * steps
        assert rank_result["accumulate/ddpx/allreduce_per_batch"] == expected


def test_manual_optimization_with_toggle_optimizer_matches_ddp(results):
    for rank_result in results:
        assert_same(
            rank_result["manual_two/ddpx_find_unused_parameters_true"],
            rank_result["manual_two/ddp_find_unused_parameters_true"],
        )


def test_manual_optimization_accumulation_syncs_only_when_stepping(results):
    for rank_result in results:
        assert_same(rank_result["manual_acc/ddpx"], rank_result["manual_acc/ddp"])
        assert rank_result["manual_acc/ddpx/allreduce_per_batch"] == [0, 1] * (STEPS // 2)


def test_parameter_unused_on_one_rank_trains_like_ddp(results):
    for rank_result in results:
        assert_same(
            rank_result["unused/ddpx_find_unused_parameters_true"],
            rank_result["unused/ddp_find_unused_parameters_true"],
        )
    assert_same(
        results[1]["unused/ddpx_find_unused_parameters_true"],
        results[0]["unused/ddpx_find_unused_parameters_true"],
        rtol=0,
        atol=0,
    )
