"""Post-local SGD through the Trainer strategy and Fabric, on 2 CPU processes.

Trainer (one 2-process job, several fits): the named hook with ``model_averaging_period`` (replicas drift
between averages and are equal right after), against torch's own ``post_localSGD_hook`` on torch's
``PostLocalSGDState`` (run unchanged on our module) and against Lightning's spelling
(``comm_hook``/``comm_state`` = torch's hook and state + ``model_averaging_period``); a resume from an
epoch-end checkpoint is bit-identical to the uninterrupted run, and the checkpoint holds the hook's
iteration and the averager's step (loaded with ``weights_only=True``). Fabric: the same named hook in a
Fabric loop against torch's hook + ``PeriodicModelAverager`` on torch's DDP, then a ``fabric.save``/``load``
resume.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_pls
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers

from tests.dist_utils import run_distributed
from tests.oracle import assert_same_tensors
from tests.strategy_helpers import fit, parameters_of, quiet

pytestmark = [pytest.mark.slow, pytest.mark.processes]

START, PERIOD = 3, 3
EPOCH_STEPS = 8  # 64 samples / 2 ranks / batch 4
OPTIONS = {"start_localSGD_iter": START, "subgroup": 1}


class Spread(Callback):
    """After each optimizer step (and averaging): the largest gap between this rank's parameters and the mean."""

    def __init__(self) -> None:
        self.gaps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.gaps.append(replica_gap(pl_module))


def replica_gap(module: nn.Module) -> float:
    """The largest difference between this rank's parameters and the ranks' mean (every rank gets it)."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    mean = flat.clone()
    dist.all_reduce(mean)
    gap = (flat - mean / dist.get_world_size()).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap)


def torch_hook_by_hand(state, bucket):
    """torch's hook, not recognised as such: the strategy keeps torch's state and adds only our averager."""
    return torch_pls.post_localSGD_hook(state, bucket)


def named_strategy():
    from lightning_ddpx import DDPXStrategy

    return DDPXStrategy(comm_hook="post_local_sgd", post_local_sgd=OPTIONS, model_averaging_period=PERIOD)


def trainer_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    from lightning_ddpx import DDPXStrategy
    from lightning_ddpx.hooks import PostLocalSGDState

    out: dict = {}
    spread = Spread()
    trainer, model = fit(named_strategy(), max_steps=-1, max_epochs=2, callbacks=[spread])
    out["named"] = parameters_of(model)
    out["named/gaps"] = spread.gaps
    state = trainer.strategy.comm_hook_state
    out["named/state"] = (state.iter, state.averager.step)

    single = dist.new_subgroups(group_size=1)[0]
    torch_state = torch_pls.PostLocalSGDState(None, single, START)
    strategy = DDPXStrategy(
        comm_hook=torch_hook_by_hand, comm_state=torch_state, model_averaging_period=PERIOD
    )
    trainer, model = fit(strategy, max_steps=-1, max_epochs=2)
    out["torch_hook"] = parameters_of(model)
    out["torch_hook/iter"] = torch_state.iter

    lightning_spelling = DDPXStrategy(
        comm_hook=torch_pls.post_localSGD_hook,
        comm_state=torch_pls.PostLocalSGDState(None, single, START),
        model_averaging_period=PERIOD,
    )
    trainer, model = fit(lightning_spelling, max_steps=-1, max_epochs=2)
    out["lightning_spelling"] = parameters_of(model)
    out["lightning_spelling/adopted"] = isinstance(trainer.strategy.comm_hook_state, PostLocalSGDState)

    # Gradient accumulation: the hook counts synchronised backwards, the averager optimizer steps: equal.
    trainer, model = fit(named_strategy(), max_steps=-1, max_epochs=2, accumulate_grad_batches=2)
    state = trainer.strategy.comm_hook_state
    out["accumulate/state"] = (state.iter, state.averager.step)

    checkpoint = ModelCheckpoint(dirpath=directory, filename="pls-{epoch}", save_on_train_epoch_end=True)
    fit(named_strategy(), max_steps=-1, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint])
    path = os.path.join(directory, "pls-epoch=0.ckpt")
    out["path"] = path
    trainer, model = fit(named_strategy(), max_steps=-1, max_epochs=2, ckpt_path=path)
    out["resumed"] = parameters_of(model)
    state = trainer.strategy.comm_hook_state
    out["resumed/state"] = (state.iter, state.averager.step)

    # The same checkpoint resumed with plain DDP: replicas must start equal, so every rank takes rank 0's.
    spread = Spread()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(DDPXStrategy(), max_steps=-1, max_epochs=2, ckpt_path=path, callbacks=[spread])
    out["plain/gaps"] = spread.gaps
    out["plain/warnings"] = [str(w.message) for w in caught if "post-local SGD" in str(w.message)]
    return out


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("pls"))
    return run_distributed(trainer_job, 2, directory, init_process_group=False, timeout=240)


def test_trainer_named_hook_drifts_between_averages_and_agrees_after(trainer_results):
    steps = 2 * EPOCH_STEPS
    for out in trainer_results:
        gaps = out["named/gaps"]
        assert len(gaps) == steps
        for step, gap in enumerate(gaps):
            if step < START or (step - START) % PERIOD == 0:
                assert gap < 1e-6, (step, gaps)
            else:
                assert gap > 1e-5, (step, gaps)
        assert out["named/state"] == (START, steps)
        assert out["accumulate/state"] == (START, steps // 2)


def test_trainer_named_hook_matches_torchs_hook_and_lightnings_spelling(trainer_results):
    for out in trainer_results:
        assert out["torch_hook/iter"] == START
        assert_same_tensors(out["named"], out["torch_hook"], "named vs torch's hook", 1e-6, 1e-6)
        assert out["lightning_spelling/adopted"]
        assert_same_tensors(
            out["named"], out["lightning_spelling"], "named vs Lightning's spelling", 0.0, 0.0
        )


def test_resuming_with_plain_ddp_starts_every_rank_from_rank0s_replica(trainer_results):
    for out in trainer_results:
        assert out["plain/gaps"] and max(out["plain/gaps"]) < 1e-6
    assert any("does not average models" in m for m in trainer_results[0]["plain/warnings"])


def test_trainer_resume_is_bit_identical_and_checkpoint_holds_the_counters(trainer_results):
    for out in trainer_results:
        assert_same_tensors(out["resumed"], out["named"], "resumed vs continuous", 0.0, 0.0)
        assert out["resumed/state"] == out["named/state"]
    checkpoint = torch.load(trainer_results[0]["path"], weights_only=True)
    replicas = checkpoint["lightning_ddpx_replicas"]  # rank 0's is the checkpoint's own state
    assert replicas[0] is None and set(replicas[1]) == {"state_dict", "optimizer_states"}
    assert not torch.equal(
        replicas[1]["state_dict"]["net.0.weight"], checkpoint["state_dict"]["net.0.weight"]
    )
    entry = checkpoint["lightning_ddpx"]
    assert entry["hook"] == "post_local_sgd"
    assert entry["shared"]["iter"] == START
    assert entry["shared"]["averager_step"] == EPOCH_STEPS


# ------------------------------------------------------------------------------------------- Fabric
def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)) for _ in range(count)
    ]


def fabric_run(data, seed: int = 0, path: str | None = None, save_at: int | None = None):
    from lightning.fabric import Fabric

    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy

    strategy = DDPXStrategy(
        comm_hook="post_local_sgd",
        post_local_sgd={**OPTIONS, "period": PERIOD},
        timeout=timedelta(seconds=60),
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = make_model(seed)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if path is not None and save_at is None:
        fabric.load(path, state)
    for step in range(state["step"], len(data)):
        x, y = data[step]
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if save_at is not None and step + 1 == save_at:
            fabric.save(path, {**state, "step": save_at})
    return model


def torch_by_hand(data) -> dict[str, torch.Tensor]:
    model = nn.parallel.DistributedDataParallel(make_model())
    model.register_comm_hook(
        torch_pls.PostLocalSGDState(None, dist.new_subgroups(group_size=1)[0], START),
        torch_pls.post_localSGD_hook,
    )
    averager = torch_averagers.PeriodicModelAverager(period=PERIOD, warmup_steps=START)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        averager.average_parameters(model.parameters())  # before zero_grad: it averages what has a gradient
        optimizer.zero_grad()
    return parameters_of(model.module)


def fabric_job(rank: int, world_size: int, directory: str) -> dict:
    quiet()
    data = batches(rank, 10)
    model = fabric_run(data)
    state = model._forward_module.comm_hook_state
    out = {"fabric": parameters_of(model.module), "state": (state.iter, state.averager.step)}
    out["torch"] = torch_by_hand(data)
    path = os.path.join(directory, "fabric.ckpt")
    fabric_run(data, path=path, save_at=5)
    out["resumed"] = parameters_of(fabric_run(data, seed=1, path=path).module)
    return out


def test_fabric_matches_torch_by_hand_and_resumes_exactly(tmp_path):
    for out in run_distributed(fabric_job, 2, str(tmp_path), init_process_group=False, timeout=180):
        assert out["state"] == (START, 10)
        assert_same_tensors(out["fabric"], out["torch"], "Fabric vs torch by hand", 1e-6, 1e-6)
        assert_same_tensors(out["resumed"], out["fabric"], "resumed vs continuous", 0.0, 0.0)


# ------------------------------------------------------------------------ several optimizers taking turns
def two_optimizers_job(rank: int, world_size: int) -> dict:
    """Two optimizers step in turn, one after the other in each batch; averaging is due every second
    optimizer step (counting from START), so always at the second optimizer's step, after its
    ``zero_grad`` left the first one's gradients ``None``. Each average must cover both optimizers'
    parameters (averaging only the stepping optimizer's, with a gradient, never averages the first one's)."""
    quiet()
    from lightning.fabric import Fabric

    from lightning_ddpx import DDPXStrategy
    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPXStrategy
    from tests.strategy_helpers import ManualTwoOptimizers

    out: dict = {}
    spread = Spread()
    strategy = DDPXStrategy(comm_hook="post_local_sgd", post_local_sgd={**OPTIONS, "period": 2})
    fit(strategy, max_steps=16, model_cls=ManualTwoOptimizers, callbacks=[spread])
    out["trainer/gaps"] = spread.gaps

    fabric = Fabric(
        accelerator="cpu", devices=2, strategy=FabricDDPXStrategy(
            comm_hook="post_local_sgd", post_local_sgd={**OPTIONS, "period": 2}, timeout=timedelta(seconds=60)
        ),
    )  # fmt: skip
    fabric.launch()
    body, head = make_model(), nn.Linear(4, 4)
    model = nn.Sequential(body, head)
    model, first, second = fabric.setup(
        model, torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)
    )
    gaps = []
    for x, y in batches(rank, 8):
        for optimizer in (first, second):
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        gaps.append(replica_gap(model))
    out["fabric/gaps"] = gaps
    return out


def test_several_optimizers_taking_turns_are_all_averaged():
    for out in run_distributed(two_optimizers_job, 2, init_process_group=False, timeout=240):
        # local steps start within the second batch; every batch ends on a due step: all replicas equal
        assert len(out["trainer/gaps"]) == 8 and max(out["trainer/gaps"]) == 0.0, out["trainer/gaps"]
        assert len(out["fabric/gaps"]) == 8 and max(out["fabric/gaps"]) == 0.0, out["fabric/gaps"]
