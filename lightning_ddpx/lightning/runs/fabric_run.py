"""How the Fabric strategy runs its processes: chosen once, when the strategy is built.

As for the Trainer (:mod:`lightning_ddpx.lightning.runs.trainer_run`): a run of
:class:`~lightning_ddpx.lightning.strategies.fabric.DDPXStrategy` is plain -- :class:`FabricRun` -- or fault tolerant --
:class:`~lightning_ddpx.lightning.fault_tolerance.runs.FaultTolerantFabricRun`. Each method is one seam where
the two differ; the strategy's overrides call it with Fabric's own behaviour as a function (``default``), and
no method of the strategy asks which run it is in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from torch import nn

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.lightning.features import post_local_sgd_setup
from lightning_ddpx.lightning.processes.popen_launcher import FabricPopenLauncher

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

    from lightning_ddpx.fault.manager import FaultTolerance
    from lightning_ddpx.lightning._compat import FabricLauncher
    from lightning_ddpx.lightning.settings.config import DDPXConfig

__all__ = ["FabricRun", "StrategyView"]

Default = Callable[[], Any]


class StrategyView(Protocol):
    """What a run reads of its strategy (either ``DDPXStrategy``, Fabric's or the Trainer's): a protocol, so
    that a run's module does not import its strategy's, which imports it."""

    @property
    def cluster_environment(self) -> Any: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def global_rank(self) -> int: ...


class FabricRun:
    """The plain run: every seam does what Fabric's DDPStrategy does (with our module and launcher)."""

    @property
    def fault(self) -> Optional["FaultTolerance"]:
        """The fault tolerance of this training process (``strategy.fault_manager``); none in a plain run."""
        return None

    def cluster_environment(self, given: Optional["ClusterEnvironment"]) -> Optional["ClusterEnvironment"]:
        return given

    def launcher(self, strategy: StrategyView, start_method: str) -> Optional["FabricLauncher"]:
        """The launcher; ``None`` leaves it to Fabric (``start_method`` other than ``"popen"``)."""
        if start_method != "popen":
            return None
        assert strategy.cluster_environment is not None
        # Fabric's, naming a lost process before anything is killed (lightning/processes/popen_launcher.py)
        return FabricPopenLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)

    def distributed_sampler_kwargs(self, strategy: StrategyView, default: Default) -> dict[str, Any]:
        return default()

    def setup_distributed(self, strategy: StrategyView, default: Default, backend: Callable[[], str]) -> None:
        """Create the default process group (``default``: the strategy's own creation)."""
        default()

    def wrap(
        self, module: nn.Module, config: "DDPXConfig", device_ids: Optional[list[int]]
    ) -> DistributedDataParallel:
        """``module`` in our module, its hook registered."""
        wrapped = config.wrap(module, device_ids=device_ids)
        config.register_hook(wrapped)
        return wrapped

    def track_optimizer(self, optimizer: Any) -> None:
        """An optimizer set up with the strategy."""

    def process_dataloader(self, dataloader: Any, lockstep: Default) -> Any:
        """Loaders iterated in lockstep across ranks (``lockstep()`` wraps one for uneven inputs)."""
        return lockstep()

    def average_after_step(self, module: DistributedDataParallel, optimizers: Sequence[Any]) -> None:
        """The module's parameter averaging (post-local SGD, DiLoCo) after a step of one of ``optimizers``."""
        post_local_sgd_setup.average_after_step(module, optimizers)

    def verification(self, verify: Callable[[], None]) -> None:
        """Run the replicas' verification, a collective between steps."""
        verify()

    def barrier(self, default: Default) -> None:
        default()

    def between_steps(self, run: Default, own: Any) -> Any:
        """A collective between steps (``fabric.broadcast``, ``all_reduce``); ``own`` is this process's own
        value, for a run that goes on when the collective fails."""
        return run()

    def state_to_save(self, state: dict[str, Any], with_ours: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What ``fabric.save`` writes: ``with_ours()`` adds the hooks' entries and, with parameter
        averaging, every rank's replicas (after verifying the replicas)."""
        return with_ours()

    def load_checkpoint(self, remainder: dict[str, Any], restore_ours: Callable[[], None]) -> None:
        """A checkpoint Fabric loaded: ``restore_ours()`` restores the hooks' entries and this rank's replica."""
        restore_ours()

    def close(self) -> None:
        """The strategy tears down."""
