"""One rank of one convergence run: ``Trainer.fit`` of the task with one contender's strategy.

Started by :func:`lightning_ddpx.bench.launch.run_ranks` as
``python -m lightning_ddpx.bench.convergence_worker CONFIG RANK`` with the rendezvous in the environment.
Each rank is launched as its own "node" (``num_nodes=world_size, devices=1``), as on a cluster, so the same
launch works over loopback and across the network namespaces of an emulated link. Rank 0 writes the curves.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything

from lightning_ddpx.bench.convergence import convergence_contenders_named
from lightning_ddpx.bench.launch import write_result

__all__ = ["CurveRecorder", "load_task"]


def load_task(model: str, datamodule: str | None) -> tuple[LightningModule, LightningDataModule | None]:
    """A built-in task name (:data:`lightning_ddpx.bench.tasks.TASKS`) or ``package.module:factory`` paths.

    A factory is a class or function called without arguments. ``datamodule=None`` with an import path for
    ``model`` means the LightningModule brings its own dataloaders.
    """
    from lightning_ddpx.bench.tasks import TASKS, build_task

    if model in TASKS and datamodule is None:
        return build_task(model)
    return _call(model, "--model"), (_call(datamodule, "--datamodule") if datamodule else None)


def _call(path: str, option: str) -> Any:
    module_name, _, attribute = path.partition(":")
    if not attribute:
        raise ValueError(f"{option} {path!r}: expected package.module:factory (or a built-in task name)")
    try:
        return getattr(importlib.import_module(module_name), attribute)()
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{option} {path!r}: cannot import it ({error})") from error


class CurveRecorder(Callback):
    """Per step: training wall time (validation excluded), train loss, bytes sent and received; per
    validation: metric. An all-reduce receives what it sends (its result: the payload's size); DiLoCo's
    sparse exchange, an all-gather, receives every other rank's payload.

    Wall time starts at the first training batch, so process start-up and the Trainer's set-up are not
    counted; the time validation takes is subtracted, so the curves compare training only.
    """

    def __init__(self, metric: str, gradient_bytes: int, verbose: bool, evaluate: str = "global") -> None:
        if evaluate not in EVALUATE:
            raise ValueError(f"evaluate must be one of {EVALUATE}, got {evaluate!r}")
        self.metric, self.gradient_bytes, self.verbose = metric, gradient_bytes, verbose
        self.evaluate = evaluate
        self._swap = contextlib.ExitStack()
        self.time_s: list[float] = []
        self.train_loss: list[float | None] = []
        self.bytes_sent: list[float | None] = []
        self.bytes_received: list[float | None] = []
        self.val: list[dict[str, Any]] = []
        self._start: float | None = None
        self._val_started = 0.0
        self._val_total = 0.0

    def _now(self) -> float:
        return time.perf_counter() - (self._start or 0.0) - self._val_total

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.time_s.append(self._now())
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.train_loss.append(float(loss) if isinstance(loss, torch.Tensor) else None)
        stats = getattr(trainer.strategy.model, "comm_stats", None)
        if stats is None:  # torch's DDP allreduces every gradient and reports nothing
            self.bytes_sent.append(float(self.gradient_bytes))
            self.bytes_received.append(float(self.gradient_bytes))
        else:
            last = stats()
            sent = None if last is None or last.bytes_sent is None else float(last.bytes_sent)
            extra_sent, extra_received = _parameter_exchange(
                getattr(trainer.strategy, "comm_hook_state", None), self.gradient_bytes
            )
            self.bytes_sent.append(None if sent is None else sent + extra_sent)
            self.bytes_received.append(None if sent is None else sent + extra_received)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_started = time.perf_counter()
        state = getattr(trainer.strategy, "comm_hook_state", None)
        if self.evaluate != "local" and hasattr(state, "global_parameters"):
            # DiLoCo: validate the global (outer) model, as the papers do, not this rank's drifted replica
            self._swap.enter_context(
                state.global_parameters() if self.evaluate == "global" else _replica_mean(state.params)
            )

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap.close()
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.metric)
        point = {
            "step": trainer.global_step,
            "time_s": self._now(),
            "metric": None if value is None else float(value),
        }
        if "val_loss" in trainer.callback_metrics and self.metric != "val_loss":
            point["val_loss"] = float(trainer.callback_metrics["val_loss"])
        self.val.append(point)
        self._val_total += time.perf_counter() - self._val_started
        if self.verbose:
            shown = "missing" if value is None else f"{float(value):.4f}"
            print(f"    step {point['step']:5d}  {point['time_s']:7.1f} s  {self.metric} {shown}", flush=True)


EVALUATE = ("global", "local", "mean")  # DiLoCo's validated model: anchors, own replica, replicas' mean


@contextlib.contextmanager
def _replica_mean(params: list[torch.Tensor]) -> Any:
    """The replicas' mean in ``params`` for the block (an all-reduce, not counted as training bytes)."""
    import torch.distributed as dist

    local = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            dist.all_reduce(p.detach())
            p.detach().div_(dist.get_world_size())
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in zip(params, local):
                p.detach().copy_(saved)


def _parameter_exchange_bytes(state: Any, parameter_bytes: int) -> float:
    """Bytes sent after this step's optimizer step, outside the gradient hook: DiLoCo's outer exchanges
    (the state counts them) and post-local SGD's model average (the whole model, when the averager ran)."""
    return _parameter_exchange(state, parameter_bytes)[0]


def _parameter_exchange(state: Any, parameter_bytes: int) -> tuple[float, float]:
    """(sent, received) of :func:`_parameter_exchange_bytes`'s exchanges."""
    take_syncs = getattr(state, "take_syncs", None)
    if callable(take_syncs):
        syncs = take_syncs()
        return float(sum(s.bytes_sent for s in syncs)), float(sum(s.bytes_received for s in syncs))
    averager = getattr(state, "averager", None)
    period = getattr(averager, "period", None)
    if averager is not None and period is not None:
        step = averager.step - 1  # the step the averager just counted
        if step >= averager.warmup_steps and (step - averager.warmup_steps) % period == 0:
            return float(parameter_bytes), float(parameter_bytes)
    return 0.0, 0.0


def run(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    if "strategy" in config:
        options = config["strategy"]
    else:
        (contender,) = convergence_contenders_named([config["contender"]])
        options = contender.strategy
    seed_everything(config["seed"], verbose=False)
    module, datamodule = load_task(config["model"], config.get("datamodule"))
    gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    recorder = CurveRecorder(
        config["metric"], gradient_bytes, verbose=rank == 0, evaluate=config.get("evaluate", "global")
    )
    if options is None:  # torch's DDP
        strategy: Any = "ddp"
    else:
        from lightning_ddpx import DDPXStrategy

        strategy = DDPXStrategy(**options)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=config["world_size"],
        strategy=strategy,
        max_steps=config["max_steps"],
        val_check_interval=config["val_every"],
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(module, datamodule=datamodule)
    if not recorder.val:
        raise RuntimeError(
            f"no validation ran in {config['max_steps']} steps: lower --val-every (it is {config['val_every']}) "
            "or give the task a val_dataloader"
        )
    if recorder.val[-1]["metric"] is None:
        raise RuntimeError(
            f"the task never logged {config['metric']!r} during validation; "
            f"logged: {sorted(trainer.callback_metrics)}. Pass --metric with one of those."
        )
    return {
        "rank": rank,
        "contender": config["contender"],
        "time_s": recorder.time_s,
        "train_loss": recorder.train_loss,
        "bytes_sent": recorder.bytes_sent,
        "bytes_received": recorder.bytes_received,
        "val": recorder.val,
        "gradient_bytes": gradient_bytes,
        "param_numel": sum(p.numel() for p in module.parameters()),
        # 1-minute load average when training ended: how busy the machine was (a shared one is noisy).
        "loadavg_1min": os.getloadavg()[0],
    }


def main(argv: list[str]) -> None:
    config_path, rank = argv[0], int(argv[1])
    with open(config_path) as f:
        config = json.load(f)
    torch.set_num_threads(config.get("threads", 1))
    torch.set_flush_denormal(True)
    # One process per "node": Lightning reads NODE_RANK; LOCAL_RANK tells it not to start processes itself.
    os.environ.update(NODE_RANK=str(rank), LOCAL_RANK="0")
    for name in ("GROUP_RANK", "SLURM_JOB_ID", "SLURM_NTASKS"):
        os.environ.pop(name, None)
    warnings.filterwarnings("ignore", message=".*(does not have many workers|num_workers|LOCAL_RANK).*")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    result = run(rank, config)
    write_result(config_path, rank, result)


if __name__ == "__main__":
    main(sys.argv[1:])
