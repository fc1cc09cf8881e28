"""Private Lightning names lightning_ddpx uses: why, and since which Lightning version (our floor is 2.4).

The Lightning layer's own compat module (see lightning_ddpx/_compat/__init__.py for the rule and why it
lives here).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.strategies.strategy import _ForwardRedirection

__all__ = [
    "PATH",
    "BackwardSyncControl",
    "DDPBackwardSyncControl",
    "ForwardRedirection",
    "StrategyRegistry",
    "WrappingCheckpointIO",
    "compiler_context",
    "forward_module",
    "is_local_path",
    "layer_sync",
    "optimizers_to_device",
    "trainer_of",
    "unwrapped_optimizer",
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
