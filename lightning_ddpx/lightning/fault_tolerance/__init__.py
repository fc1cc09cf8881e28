"""``fault_tolerance`` in the strategies: a lost rank does not end ``fit``.

- :mod:`.runs`: the fault-tolerant runs of the Trainer and of Fabric (the Lightning adapter of
  :class:`lightning_ddpx.fault.FaultTolerance`);
- :mod:`.launch`: the process the user started supervises the training processes and trains nothing;
- :mod:`.metrics`: torchmetrics' own syncs routed through the voted between-steps rule;
- :mod:`.state`: the whole training state, one digest per piece, that a heal proves equal.
"""
