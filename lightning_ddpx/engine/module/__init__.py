"""The module's surface: :class:`~.data_parallel.DistributedDataParallel`, the ``nn.Module`` users wrap.

Re-exported here: ``lightning_ddpx.engine.module.DistributedDataParallel`` is the path that pickles of a
wrapped model made before the engine's rooms name.

- :mod:`.data_parallel`: the class: torch's arguments and methods, forward, ``no_sync``, hooks, reports;
- :mod:`.join`: uneven inputs, torch's ``join()`` protocol;
- :mod:`.trainable_set`: parameters whose ``requires_grad`` changes after wrapping;
- :mod:`.synced_buffers`, :mod:`.placement`, :mod:`.pickling`, :mod:`.rank_settings`,
  :mod:`.unsupported_options`: buffers, devices, copies, the settings every rank compares, and torch's
  arguments not implemented here.
"""

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel, NothingToSynchronise

__all__ = ["DistributedDataParallel", "NothingToSynchronise"]
