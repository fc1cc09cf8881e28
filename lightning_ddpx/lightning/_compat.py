"""Private Lightning names lightning_ddpx uses: why, and since which Lightning version (our floor is 2.5,
pyproject.toml's).

The Lightning layer's own compat module (see lightning_ddpx/_compat/__init__.py for the rule and why it
lives here).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
from lightning.fabric.strategies.launchers.launcher import _Launcher as _FabricLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricSubprocessLauncher,
)
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.strategies.launchers.launcher import _Launcher as _TrainerLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _TrainerSubprocessLauncher,
)
from lightning.pytorch.strategies.strategy import _ForwardRedirection

__all__ = [
    "PATH",
    "BackwardSyncControl",
    "ContinuingCSVWriter",
    "DDPBackwardSyncControl",
    "FabricLauncher",
    "FabricSubprocessLauncher",
    "ForwardRedirection",
    "StrategyRegistry",
    "TrainerLauncher",
    "TrainerSubprocessLauncher",
    "WrappingCheckpointIO",
    "compiler_context",
    "discard_closure_result",
    "dump_checkpoint",
    "exit_now",
    "forward_module",
    "is_fitting",
    "is_local_path",
    "layer_sync",
    "optimizers_to_device",
    "parse_num_batches",
    "pin_logger",
    "restore_on_fit",
    "script_command",
    "set_threads_per_process",
    "start_children",
    "train_combined_loader",
    "trainer_of",
    "unwrapped_optimizer",
    "versioned_loggers",
    "weights_only_argument",
    "wrap_closure",
]

# The registries' type, for registering our names with both the Trainer's and Fabric's registries. >= 2.0.
StrategyRegistry = _StrategyRegistry

# Fabric's base for no_backward_sync(): our Fabric strategy plugs the module's no_sync() in. >= 2.0.
BackwardSyncControl = _BackwardSyncControl

# Fabric DDP's own no_backward_sync(): ours subclasses it, so code that checks for Fabric's DDP sync control
# (``isinstance(strategy._backward_sync_control, _DDPBackwardSyncControl)``) accepts ours. >= 2.0.
DDPBackwardSyncControl = _DDPBackwardSyncControl

# Lightning's type of a checkpoint path (str or PathLike), for our CheckpointIO's signatures. >= 2.0.
PATH = _PATH

# Lightning's plain forward redirection: its DDP one toggles torch-DDP attributes ours does not have. >= 2.1.
ForwardRedirection = _ForwardRedirection

# CheckpointIO plugins that wrap another (AsyncCheckpointIO): ours fills an empty inner slot. >= 2.0.
WrappingCheckpointIO = _WrappingCheckpointIO

# Moves optimizer state to the model's device after wrapping, as Lightning's strategies do. >= 2.0.
optimizers_to_device = _optimizers_to_device

# Whether a checkpoint path is on the local filesystem (atomic rename) rather than a remote fsspec one. >= 2.0.
is_local_path = _is_local_file_protocol


def trainer_of(module: Any) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, without the error ``module.trainer`` raises when it is
    not attached (``None`` then). >= 2.0."""
    return module._trainer


def layer_sync(strategy: Any) -> Any:
    """A strategy's layer-sync plugin (``Trainer(sync_batchnorm=True)`` sets it), applied at setup. >= 2.0."""
    return strategy._layer_sync


def forward_module(model: Any) -> Any:
    """The module a model returned by ``fabric.setup`` forwards to (``_FabricModule._forward_module``: the
    strategy's wrapper, ours), or ``model`` itself if it is not Fabric's wrapper. The public ``.module`` is
    the user's unwrapped module instead. >= 2.0; checked on 2.6.6."""
    return getattr(model, "_forward_module", model)


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` or Fabric's ``_FabricOptimizer`` (both
    keep it in ``_optimizer``), or ``optimizer`` itself if it is neither. >= 2.0; checked on 2.6.6."""
    return getattr(optimizer, "_optimizer", optimizer)


def wrap_closure(precision: Any, model: Any, optimizer: Any, closure: Any) -> Any:
    """``Precision._wrap_closure``: run ``closure`` (training step and backward), then the
    ``on_before_optimizer_step`` hooks, as ``Precision.optimizer_step`` does inside ``optimizer.step``; for a
    step that runs the closure without calling ``optimizer.step``. >= 2.0; checked on 2.6.6."""
    return precision._wrap_closure(model, optimizer, closure)


def compiler_context(module: Any) -> Any:
    """What ``Trainer.fit(torch.compile(module))`` recorded on the module: the dynamo context and the
    original ``training_step`` (``None`` if it was not compiled). >= 2.1."""
    return getattr(module, "_compiler_ctx", None)


def weights_only_argument(weights_only: Optional[bool]) -> dict[str, Optional[bool]]:
    """The ``weights_only`` keyword for the base strategies' ``load_checkpoint``: Lightning 2.6 added it, and
    2.5's does not take it (nor does its Trainer or Fabric pass it). Given only when set, so both work; unset
    means Lightning's default either way. Public API, but version-dependent: kept here with the others."""
    return {} if weights_only is None else {"weights_only": weights_only}


# The launchers' bases, for the fault-tolerant launchers (the process the user started supervises). >= 2.0.
TrainerLauncher = _TrainerLauncher
FabricLauncher = _FabricLauncher


# Lightning's popen launchers (the user's process is rank 0 and starts the others with the script's
# command), for ours, which name a lost process before anything is killed (lightning/processes/popen_launcher.py).
# A subclass, so Lightning's checks for its launcher (the Trainer's Ctrl-C path) accept ours. >= 2.0.
TrainerSubprocessLauncher = _TrainerSubprocessLauncher
FabricSubprocessLauncher = _FabricSubprocessLauncher


def start_children(launcher: Any) -> None:
    """A popen launcher's children (local ranks 1..N-1, ``launcher.procs``), started as Lightning starts
    them: the rendezvous variables set in this process, each child's own ``LOCAL_RANK``, Hydra's command
    when Hydra runs. >= 2.0; checked on 2.6.6."""
    launcher._call_children_scripts()


def set_threads_per_process(num_processes: int) -> None:
    """Lightning's OpenMP thread count for ``num_processes`` processes on one machine, unless the user set
    ``OMP_NUM_THREADS``; its popen launchers call it before running the function. >= 2.0; checked on 2.6.6."""
    _set_num_threads_if_needed(num_processes=num_processes)


def script_command() -> list[str]:
    """The command that runs this script again (``python script.py args`` or ``python -m module args``), as
    Lightning's ``popen`` launcher builds it for its children. >= 2.0."""
    return list(_basic_subprocess_cmd())


def is_fitting(trainer: Any) -> bool:
    """Whether the Trainer is in ``fit`` (``trainer.state.fn``). Public, kept with the launcher's needs."""
    from lightning.pytorch.trainer.states import TrainerFn

    return trainer.state.fn == TrainerFn.FITTING


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The dict ``trainer.save_checkpoint`` writes (module, optimizers, schedulers, loops, callbacks), built
    in memory by the Trainer's checkpoint connector: what a fault-tolerant run's newcomer receives. >= 2.0;
    checked on 2.6.6."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def restore_on_fit(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Make the coming ``fit`` restore ``checkpoint`` as from ``ckpt_path``: the connector restores whatever
    it holds in ``_loaded_checkpoint`` (model and callbacks before the strategy's setup, then optimizers,
    schedulers and loops). Set before the restore starts (in the strategy's ``setup_environment``). >= 2.0;
    checked on 2.6.6."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def train_combined_loader(trainer: Any) -> Any:
    """The fit loop's combined training loader (``limits`` per loader), ``None`` before it is built. >= 2.0;
    checked on 2.6.6."""
    return getattr(trainer.fit_loop, "_combined_loader", None)


def versioned_loggers(trainer: Any) -> list[Any]:
    """The loggers whose version names their directory (CSV, TensorBoard: their ``_version``). >= 2.0."""
    return [logger for logger in trainer.loggers if hasattr(logger, "_version")]


def pin_logger(logger: Any, version: Any, writer: Any = None) -> None:
    """Fix a logger's version (its directory) before it picks the next free one, and, given, the experiment
    writer it logs through. >= 2.0; checked on 2.6.6."""
    logger._version = version
    if writer is not None:
        logger._experiment = writer


def exit_now(code: int) -> None:
    """``os._exit``: Python's documented immediate exit (no interpreter finalisation), kept here because its
    name reads as private to the structure test's scan."""
    os._exit(code)


def discard_closure_result(closure: Any) -> None:
    """Mark an automatic-optimisation closure as having produced no loss (as a ``training_step`` returning
    ``None`` does), so that the loop skips the batch's output: a fault-tolerant step whose closure failed
    mid-backward has none. >= 2.0; checked on 2.6.6."""
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    if hasattr(closure, "_result") and closure._result is None:
        closure._result = ClosureResult(closure_loss=None)


def parse_num_batches(length: Any, limit: Any, validation: bool = False) -> Any:
    """How many batches an epoch takes from a loader of ``length`` under ``limit_train_batches`` (or
    ``limit_val_batches``), as the fit loop (the validation loop) computes it when it builds its loader
    (recomputed when the membership reshards). >= 2.0."""
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    stage = RunningStage.VALIDATING if validation else RunningStage.TRAINING
    return _parse_num_batches(stage, length, limit)


def combined_length(combined: Any, limits: list[Any]) -> Any:
    """How many batches ``combined`` (a CombinedLoader) gives once its iterator is built with ``limits``:
    the length of its mode's iterator over its loaders (``len(combined)`` answers for the iterator built
    last, before the new limits). Building the iterator object starts no loader. >= 2.0; checked on 2.5.0
    and 2.6.6."""
    from lightning.pytorch.utilities.combined_loader import _SUPPORTED_MODES

    return len(_SUPPORTED_MODES[combined._mode]["iterator"](combined.flattened, limits))


# ModelCheckpoint's own progress, not in its state_dict: when it last saved (it saves at most once per global
# step), what, and whether a save waits for the validation. A Lightning resume starts every rank alike from the
# defaults; a fault-tolerant newcomer must take the live peer's, or it saves (a collective) where they do not.
_CHECKPOINT_PROGRESS = ("_last_global_step_saved", "_last_checkpoint_saved", "_defer_save_until_validation")


def model_checkpoint_progress(callback: Any) -> dict[str, Any]:
    """A ModelCheckpoint's progress that its ``state_dict`` leaves out. >= 2.0; checked on 2.6.6."""
    return {name: getattr(callback, name) for name in _CHECKPOINT_PROGRESS if hasattr(callback, name)}


def restore_model_checkpoint_progress(callback: Any, progress: dict[str, Any]) -> None:
    """Adopt :func:`model_checkpoint_progress`'s output. >= 2.0; checked on 2.6.6."""
    for name, value in progress.items():
        if name in _CHECKPOINT_PROGRESS:
            setattr(callback, name, value)


def metric_is_synced(metric: Any) -> bool:
    """Whether a torchmetrics ``Metric`` holds synced states (``unsync()`` refuses one that does not).
    torchmetrics >= 0.8; checked on 1.x."""
    return bool(getattr(metric, "_is_synced", False))


def set_training_batches(trainer: Any, batches: Any) -> None:
    """The fit loop's batches per epoch, and the batch at which a fractional ``val_check_interval``
    validates, as the fit loop's ``setup_data`` derives it from them (an int interval or an unsized loader
    is left as it is). >= 2.0; checked on 2.6.6."""
    trainer.fit_loop.max_batches = batches
    interval = trainer.val_check_interval
    if isinstance(interval, float) and isinstance(batches, int) and trainer.val_check_batch is not None:
        if getattr(trainer, "_val_check_time_interval", None) is None:
            trainer.val_check_batch = max(1, int(batches * interval))


def validation_loaders(trainer: Any) -> list[Any]:
    """The validation loop's loaders during fit (empty before it built them). >= 2.0; checked on 2.6.6."""
    combined = getattr(trainer.fit_loop.epoch_loop.val_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


def set_validation_batches(trainer: Any, counts: list[Any]) -> None:
    """The validation loop's batches per loader (it sets the loaders' limits from them right after it sets
    their samplers' epoch). >= 2.0; checked on 2.6.6."""
    trainer.fit_loop.epoch_loop.val_loop._max_batches = list(counts)


class ContinuingCSVWriter(ExperimentWriter):
    """Lightning's CSV experiment writer, minus its start-up check (``_check_log_dir_exists``), which deletes
    an existing ``metrics.csv``: a fault-tolerant run's new rank 0 continues the file the lost one wrote.
    Before each save its columns take in the file's header as it is then (another process, rank 0 until it
    was lost, may have added columns since this writer started), so appended rows line up and a rewrite
    for new columns keeps every column and row already there. >= 2.0; checked on 2.6.6."""

    def _check_log_dir_exists(self) -> None:
        self._adopt_file_columns()

    def _record_new_keys(self) -> set[str]:
        self._adopt_file_columns()
        return super()._record_new_keys()

    def _adopt_file_columns(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                header = file.readline().strip()
            self.metrics_keys = sorted(set(self.metrics_keys) | set(filter(None, header.split(","))))
