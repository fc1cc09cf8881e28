"""How the Trainer strategy runs its processes: chosen once, when the strategy is built.

A run of :class:`~lightning_ddpx.lightning.strategies.trainer.DDPXStrategy` is either plain -- :class:`TrainerRun`, what
torch's DDP does under Lightning -- or fault tolerant --
:class:`~lightning_ddpx.lightning.fault_tolerance.runs.FaultTolerantTrainerRun`, where a lost rank does not end
``trainer.fit``. The engine picks its ``Transport`` once in the same way. Each method of :class:`TrainerRun` is
one seam where the two runs differ; the strategy's overrides call it, handing it Lightning's own behaviour as
a function (``default``), so that no method of the strategy asks which run it is in, and what fault tolerance
does at a seam is written once, in its run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

import torch
from lightning.pytorch.trainer.states import RunningStage

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.lightning.features import post_local_sgd_setup
from lightning_ddpx.lightning.processes.popen_launcher import PopenLauncher
from lightning_ddpx.lightning.runs.fabric_run import StrategyView

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

    from lightning_ddpx.lightning._compat import TrainerLauncher
    from lightning_ddpx.lightning.settings.config import DDPXConfig

__all__ = ["TrainerRun", "TrainerStrategyView"]

Default = Callable[[], Any]


class TrainerStrategyView(StrategyView, Protocol):
    """What the Trainer's runs read of :class:`~lightning_ddpx.lightning.strategies.trainer.DDPXStrategy` beyond
    :class:`~lightning_ddpx.lightning.runs.fabric_run.StrategyView`."""

    @property
    def launcher(self) -> Any: ...
    def set_world_ranks(self) -> None: ...


class TrainerRun:
    """The plain run: every seam does what Lightning's DDPStrategy does (with our module and launcher)."""

    def cluster_environment(self, given: Optional["ClusterEnvironment"]) -> Optional["ClusterEnvironment"]:
        """The cluster environment the strategy hands Lightning: the one given (``None``: Lightning's)."""
        return given

    def launcher(
        self, strategy: TrainerStrategyView, start_method: str, backend: Callable[[], str]
    ) -> Optional["TrainerLauncher"]:
        """The launcher; ``None`` leaves it to Lightning (``start_method`` other than ``"popen"``)."""
        if start_method != "popen":
            return None
        assert strategy.cluster_environment is not None
        # Lightning's, naming a lost process before anything is killed (lightning/processes/popen_launcher.py)
        return PopenLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)

    def distributed_sampler_kwargs(self, strategy: TrainerStrategyView, default: Default) -> dict[str, Any]:
        return default()

    def setup_distributed(
        self, strategy: TrainerStrategyView, default: Default, backend: Callable[[], str]
    ) -> None:
        """Create the default process group (``default``: the strategy's own creation; ``backend()`` the
        process group backend it uses)."""
        default()

    def set_world_ranks(self, strategy: TrainerStrategyView, default: Default) -> None:
        default()

    def init_sync(self) -> Optional[bool]:
        """The module's ``init_sync`` (``None``: as configured): whether the wrap broadcasts rank 0's weights."""
        return None

    def register_hook(self, model: DistributedDataParallel, config: "DDPXConfig") -> tuple[Any, bool]:
        """Build and register the communication hook; returns its state and whether the strategy keeps that
        state in its checkpoints (a plain run does)."""
        return config.register_hook(model), True

    def after_setup(self, module: Any) -> None:
        """The LightningModule is set up for fitting (wrapped, its optimizers built)."""

    def process_dataloader(self, dataloader: Any, stage: Optional[RunningStage], training: Default) -> Any:
        """A loader Lightning is about to iterate in ``stage``: training loaders in lockstep (``training()``
        wraps it for uneven inputs), the others as they are."""
        return training() if stage == RunningStage.TRAINING else dataloader

    def on_train_batch_start(self, batch_idx: int) -> None:
        """A training batch starts (before its ``training_step``)."""

    def accumulating_step(self, run: Default, device: torch.device) -> Any:
        """A micro-batch's ``training_step`` whose backward accumulates locally (gradient accumulation)."""
        return run()

    def optimizer_step(
        self,
        step: Callable[[Callable[[], Any]], Any],
        closure: Callable[[], Any],
        batch_idx: int,
        model: Optional[DistributedDataParallel],
        optimizers: Sequence[Any],
    ) -> Any:
        """``step(closure)``, then the module's parameter averaging (post-local SGD, DiLoCo) when it has one."""
        result = step(closure)
        if model is not None and model.parameter_averaging is not None:
            post_local_sgd_setup.average_after_step(model, optimizers)
        return result

    def verification(self, verify: Callable[[], None]) -> None:
        """Run the replicas' verification, a collective between steps."""
        verify()

    def barrier(self, default: Default) -> None:
        default()

    def between_steps(self, run: Default, fallback: Default) -> Any:
        """A collective of Lightning's between steps (a broadcast, a reduction, a gather); ``fallback`` is this
        process's own value, for a run that goes on when the collective fails."""
        return run()

    def agree(self, decision: bool) -> bool:
        """A boolean decision reduced between steps: one on every rank."""
        return decision

    def validation_step(self, wrapped: Default, own: Default) -> Any:
        """A validation step: through the wrapper's forward (``wrapped``, as Lightning's) or the
        LightningModule's own (``own``)."""
        return wrapped()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], add_state: Callable[[], None], write: Default
    ) -> None:
        """Add our state to ``checkpoint`` (``add_state``: the hook's and, with parameter averaging, every
        rank's replica), then ``write`` it (rank 0 writes)."""
        add_state()
        write()

    def remove_checkpoint(self, remove: Default) -> None:
        remove()

    def load_checkpoint(self, checkpoint: dict[str, Any], take_state: Callable[[], None]) -> None:
        """A checkpoint Lightning loaded: ``take_state`` keeps our entries until the module exists."""
        take_state()

    def close(self) -> None:
        """The strategy tears down (every time ``fit``, ``validate``, ... ends)."""
