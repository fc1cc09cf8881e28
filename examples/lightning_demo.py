"""Lightning + lightning_ddpx on 2 CPU processes: PowerSGD training on digits, a checkpoint, a resume.

    python examples/lightning_demo.py                       # about a minute on 2 cores
    python examples/lightning_demo.py --hook allreduce      # the uncompressed baseline
    python examples/lightning_demo.py --epochs 3 --resume-epochs 3 --rank 4 --workdir /tmp/ddpx_demo

What it shows, in order:
1. an ordinary LightningModule (examples/digits.py) trained by ``Trainer(strategy=DDPXStrategy(...))``
   on 2 processes, with PowerSGD compressing the gradients (accuracy measured with torchmetrics);
2. the checkpoint Lightning wrote: it loads with ``torch.load(weights_only=True)`` and holds PowerSGD's
   shared state once and the error feedback of *each* rank;
3. a new Trainer resuming from it with ``fit(ckpt_path=...)``: PowerSGD continues where it stopped;
4. that both processes end with identical parameters.

Lightning starts the second process itself by running this script again (its ``popen`` launcher); only
rank 0 prints. The data set ships inside scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
import tempfile
import time
import warnings

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ddpx import DDPXStrategy
from lightning_ddpx.hooks import PowerSGDOptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # digits.py lives next to this script
from digits import DigitsClassifier, DigitsDataModule  # noqa: E402

STARTED = time.perf_counter()
IS_LAUNCHER = (
    "LOCAL_RANK" not in os.environ
)  # the process the user started (rank 0), before Lightning's launch


def say(message: str = "") -> None:
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, flush=True)


class Report(Callback):
    """One line per epoch on rank 0: loss, accuracy, and what the hook did."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state = trainer.strategy.comm_hook_state
        if trainer.current_epoch > 0 and trainer.is_global_zero:
            iteration = (
                f", hook state restored at PowerSGD step {state.iter}" if hasattr(state, "iter") else ""
            )
            say(f"  resumed at epoch {trainer.current_epoch} (global step {trainer.global_step}){iteration}")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        say(
            f"  [{self.phase}] epoch {trainer.current_epoch + 1}: val_loss {float(metrics['val_loss']):.3f}  "
            f"val_acc {100 * float(metrics['val_acc']):5.1f}%"
            + describe_hook(trainer.strategy.comm_hook_state)
        )


def describe_hook(state: object) -> str:
    stats = getattr(state, "compression_stats", None)
    if stats is None:
        return ""
    snapshot = stats()
    if not snapshot.numel_after:
        return f"  | PowerSGD step {snapshot.iteration}: plain allreduce until step {state.options.start_powerSGD_iter}"
    return (
        f"  | PowerSGD step {snapshot.iteration}: sends 1/{snapshot.compression_rate:.1f} of the gradient "
        "elements"
    )


def make_strategy(args: argparse.Namespace) -> DDPXStrategy:
    if "powersgd" in args.hook:
        options = PowerSGDOptions(matrix_approximation_rank=args.rank, start_powerSGD_iter=args.start_iter)
        return DDPXStrategy(comm_hook=args.hook, powersgd=options)
    return DDPXStrategy(comm_hook=args.hook)


def make_trainer(
    args: argparse.Namespace, max_epochs: int, phase: str, checkpoint: ModelCheckpoint
) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=make_strategy(args),
        max_epochs=max_epochs,
        callbacks=[Report(phase), checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )


def describe_checkpoint(path: str) -> None:
    checkpoint = torch.load(path, weights_only=True)  # tensors and plain values only: no code is unpickled
    entry = checkpoint["lightning_ddpx"]
    say(
        f"  {os.path.basename(path)}: loaded with torch.load(weights_only=True); hook {entry['hook']!r}, "
        f"written by {entry['world_size']} processes"
    )
    shared, per_rank = entry["shared"], entry["per_rank"]
    if shared is None:
        say("  (a stateless hook: nothing to save besides its name)")
        return
    say(
        f"  shared (saved once): iteration {shared['iteration']}, warm-start Q for {len(shared['q'])} bucket(s)"
    )
    for rank, part in enumerate(per_rank):
        errors = list(part["error"].values())
        numel = sum(e.numel() for e in errors)
        norm = torch.linalg.vector_norm(torch.cat([e.reshape(-1) for e in errors])).item() if errors else 0.0
        say(f"  per rank {rank}: error feedback of {numel} values, norm {norm:.4f}")


def parameters_agree(trainer: Trainer, model: LightningModule) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(trainer.world_size)]
    torch.distributed.all_gather(everyone, flat)  # the process group outlives fit
    return all(torch.equal(everyone[0], other) for other in everyone)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hook", default="powersgd", help="comm hook name (default: powersgd)")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix_approximation_rank (default: 2)")
    parser.add_argument(
        "--start-iter", type=int, default=10, help="PowerSGD start_powerSGD_iter (default: 10)"
    )
    parser.add_argument("--epochs", type=int, default=4, help="epochs before the checkpoint (default: 4)")
    parser.add_argument("--resume-epochs", type=int, default=4, help="epochs after resuming (default: 4)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "lightning_ddpx_demo"))
    args = parser.parse_args()

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # keep Lightning's banners out
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
    if IS_LAUNCHER:
        # Start fresh (Lightning would otherwise write phase1-v1.ckpt); only the launching process does this.
        for old in glob.glob(os.path.join(args.workdir, "phase[12]*.ckpt")):
            os.remove(old)

    say(
        f"lightning_ddpx demo: DDPXStrategy(comm_hook={args.hook!r}) on 2 CPU processes (gloo), "
        "scikit-learn digits (1347 train / 450 validation images)"
    )
    say(f"\n1. Train {args.epochs} epochs, then Lightning's ModelCheckpoint writes a checkpoint")
    seed_everything(0, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=args.workdir, filename="phase1")
    trainer = make_trainer(args, args.epochs, "phase 1", checkpoint)
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule())
    path = checkpoint.last_model_path or checkpoint.best_model_path

    say("\n2. What the checkpoint holds for the communication hook")
    if trainer.is_global_zero:
        describe_checkpoint(path)
    trainer.strategy.barrier()

    total = args.epochs + args.resume_epochs
    say(f"\n3. A new Trainer and a fresh model resume with fit(ckpt_path=...) up to epoch {total}")
    seed_everything(0, verbose=False)
    model = DigitsClassifier()
    trainer = make_trainer(args, total, "phase 2", ModelCheckpoint(dirpath=args.workdir, filename="phase2"))
    trainer.fit(model, datamodule=DigitsDataModule(), ckpt_path=path)

    agree = parameters_agree(trainer, model)
    accuracy = 100 * float(trainer.callback_metrics["val_acc"])
    say(
        f"\n4. Final validation accuracy {accuracy:.1f}% (torchmetrics, over both processes' shards); "
        f"parameters identical on both processes: {'yes' if agree else 'NO'}"
    )
    say(f"   checkpoint: {path}; training, checkpoint and resume took {time.perf_counter() - STARTED:.0f} s")
    if not agree:
        raise SystemExit("the processes ended with different parameters")


if __name__ == "__main__":
    main()
