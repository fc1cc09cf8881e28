"""A fault-tolerant Lightning Trainer job for the tests: ``Trainer(devices=N, strategy=DDPXStrategy(fault_tolerance=...))``.

    python tests/jobs/fault_trainer_job.py OUT_DIR

Run by the user's process, ``fit`` starts the training processes under the supervisor and returns with the
trained weights; the launching process then writes ``OUT_DIR/main.json`` (its ``global_step``, epoch and
weights' digest and how many samples its ``trainer.test`` saw). Each training process appends, after every optimizer step it applies,
``uid pid generation world_size global_step epoch batch digest hook`` to ``OUT_DIR/<uid>.log`` (``hook``:
PowerSGD's iteration and a digest of its shared state, or ``-``).

Environment: ``FAULT_JOB_KILL=uid:global_step:point`` (several, comma-separated: one run, several losses)
makes training process ``uid`` SIGKILL itself at that global step, at ``forward`` (in ``training_step``),
``backward`` (from a gradient hook, buckets in flight), ``optimizer`` (after the members committed the step, before it is applied), ``save`` (inside a checkpoint
save of ``ModelCheckpoint(every_n_train_steps=2)``) or ``validation`` (in ``validation_step``, whose
torchmetrics metric the survivors then compute); ``between`` does not kill: checkpoint saving's all-reduce
after that step (its file-exists decision) fails on that process alone (issued, then a communication failure raised), while the
others' succeeds. Each validation appends ``global_step val_mse`` to
``OUT_DIR/<uid>.val``. ``FAULT_JOB_DEVICES`` (3), ``FAULT_JOB_EPOCHS`` (3),
``FAULT_JOB_RESUME`` (a checkpoint for ``fit(ckpt_path=...)``), ``FAULT_JOB_REPLACEMENTS`` (1), ``FAULT_JOB_HOOK`` (``powersgd``: compressing from step 2; ``diloco``,
``diloco-streaming``, ``post_local_sgd``: the hook column is then ``count:digest`` of the hook's shared state,
see ``averaging_digest``), ``FAULT_JOB_UNEVEN`` (no DistributedSampler: each rank its own slice of the data, rank 2's a batch shorter),
``FAULT_JOB_ACCUMULATE`` (``accumulate_grad_batches``, 1).

While fewer than ``FAULT_JOB_DEVICES`` members train, each batch's end waits for a replacement the launcher
started to register (:func:`wait_for_a_started_replacement`): it is then admitted at the next epoch's start
on any machine, fast or loaded, and no step waits when none is on its way.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_ddpx import DDPXStrategy
from lightning_ddpx.engine.agreement.errors import CommunicationError
from tests.jobs.fault_job import hook_digest, wait_for_a_started_replacement

SAMPLES, BATCH = 96, 4


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def averaging_digest(shared: dict) -> str:
    """``count:digest`` of an averaging hook's shared state: DiLoCo's inner steps and anchors, post-local SGD's
    iteration and averager step."""
    if "anchors" in shared:
        h = hashlib.sha256()
        for anchor in shared["anchors"]:
            h.update(anchor.numpy().tobytes())
        return f"{shared['step']}:{h.hexdigest()[:16]}"
    return f"{shared['averager_step']}:{shared['iter']}"


class Job(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.uid = os.environ.get("DDPX_FT_UID", "main")
        # this process's own (global step, point) pairs of FAULT_JOB_KILL: uid:step:point[,uid:step:point...]
        self.kills = {
            (int(step), point)
            for uid, step, point in (
                entry.split(":") for entry in os.environ.get("FAULT_JOB_KILL", "").split(",") if entry
            )
            if uid == self.uid
        }
        self.tested = 0
        self.val_mse = torchmetrics.MeanSquaredError()  # synced by torchmetrics itself at the epoch's end
        if any(point == "backward" for _, point in self.kills):
            self.net[0].weight.register_hook(self._die_in_backward)
        if any(point == "between" for _, point in self.kills):
            self._fail_a_collective_between_steps()

    def _fail_a_collective_between_steps(self) -> None:
        real = torch.distributed.all_reduce

        def all_reduce(*args, **kwargs):
            result = real(*args, **kwargs)
            if self._victim_at("between") and not self.trainer.strategy._run.fault.inside_step:
                self.kills.discard((self.trainer.global_step, "between"))  # once
                raise CommunicationError(f"injected failure between steps in process {self.uid}")
            return result

        torch.distributed.all_reduce = all_reduce

    def _victim_at(self, point: str) -> bool:
        return self._trainer is not None and (self.trainer.global_step, point) in self.kills

    def maybe_die(self, point: str) -> None:
        if self._victim_at(point):
            os.kill(os.getpid(), signal.SIGKILL)

    def _die_in_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.maybe_die("backward")
        return grad

    def training_step(self, batch, batch_idx):
        self.maybe_die("forward")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.maybe_die("validation")
        x, y = batch
        prediction = self.net(x)
        self.val_mse(prediction, y)
        self.log("val_mse", self.val_mse)  # first: its sync is the first collective after a loss here
        self.log("val_loss", nn.functional.mse_loss(prediction, y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        with open(os.path.join(os.environ["FAULT_JOB_OUT"], f"{self.uid}.val"), "a") as log:
            metrics = self.trainer.callback_metrics
            print(self.trainer.global_step, float(metrics["val_mse"]), file=log)

    def test_step(self, batch, batch_idx):
        self.tested += len(batch[0])

    def on_before_optimizer_step(self, optimizer) -> None:
        self.maybe_die("optimizer")

    def on_save_checkpoint(self, checkpoint) -> None:
        self.maybe_die("save")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        strategy = self.trainer.strategy
        fault = strategy._run.fault
        shared = fault.hook_state_dict()  # the hook's shared state: equal on every member, always
        hook = (
            "-"
            if shared is None
            else averaging_digest(shared)
            if "iteration" not in shared
            else (f"{shared['iteration']}:{hook_digest(shared)}")
        )
        with open(os.path.join(os.environ["FAULT_JOB_OUT"], f"{self.uid}.log"), "a") as log:
            log.write(
                f"{self.uid} {os.getpid()} {fault.generation.number} {fault.world_size} "
                f"{self.trainer.global_step} {self.current_epoch} {batch_idx} {digest(self.net)} {hook}\n"
            )
        if fault.world_size < int(os.environ.get("FAULT_JOB_DEVICES", "3")):
            wait_for_a_started_replacement(fault)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)]

    def _data(self) -> TensorDataset:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, 8, generator=g)
        return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())

    def train_dataloader(self):
        if os.environ.get("FAULT_JOB_UNEVEN"):  # each rank its own slice, rank 2's a batch shorter
            rank, size = self.global_rank, self.trainer.world_size
            share = list(range(rank, SAMPLES, size))
            return DataLoader(Subset(self._data(), share[:-BATCH] if rank == 2 else share), batch_size=BATCH)
        return DataLoader(self._data(), batch_size=BATCH, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self._data(), batch_size=16)

    def test_dataloader(self):
        return DataLoader(self._data(), batch_size=16)


def main() -> None:
    out = sys.argv[1]
    os.environ["FAULT_JOB_OUT"] = out
    options = {
        "replacements": int(os.environ.get("FAULT_JOB_REPLACEMENTS", "1")),
        "heartbeat_timeout_s": 5.0,
        "collective_timeout_s": 20.0,
        "join_timeout_s": 120.0,
    }
    hook = os.environ.get("FAULT_JOB_HOOK") or None
    # PowerSGD compressing from step 2 (of 8 per epoch): a discarded step is rolled back, a newcomer gets its
    # shared state
    powersgd = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1} if hook == "powersgd" else None
    # DiLoCo: an outer step every 3 inner steps; post-local SGD: 2 steps of global averaging, then local
    # steps averaged every 3; streaming DiLoCo (diloco-streaming): two fragments sent in turn every 3 steps, each
    # applied a step later and mixed
    averaging = {
        "diloco": {"diloco": {"period": 3}},
        "diloco-streaming": {"diloco": {"period": 6, "fragments": 2, "mixing": 0.5, "overlap_steps": 1}},
        "post_local_sgd": {"post_local_sgd": {"start_localSGD_iter": 2, "period": 3, "subgroup": 1}},
    }.get(hook or "", {})
    hook = "diloco" if hook == "diloco-streaming" else hook
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("FAULT_JOB_DEVICES", "3")),
        strategy=DDPXStrategy(fault_tolerance=options, comm_hook=hook, powersgd=powersgd, **averaging),
        max_epochs=int(os.environ.get("FAULT_JOB_EPOCHS", "3")),
        accumulate_grad_batches=int(os.environ.get("FAULT_JOB_ACCUMULATE", "1")),
        logger=CSVLogger(out, name="logs"),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), every_n_train_steps=2)],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        use_distributed_sampler=not os.environ.get("FAULT_JOB_UNEVEN"),
    )
    model = Job()
    trainer.fit(model, ckpt_path=os.environ.get("FAULT_JOB_RESUME") or None)
    fitted = digest(model.net)
    trainer.test(model, verbose=False)  # after fit: once, in this process, on the trained weights
    with open(os.path.join(out, "main.json"), "w") as f:
        json.dump(
            {
                "pid": os.getpid(),
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "digest": fitted,
                "tested_samples": model.tested,
                "status": str(trainer.state.status),
                "best_model_path": trainer.checkpoint_callback.best_model_path,
            },
            f,
        )


if __name__ == "__main__":
    main()
