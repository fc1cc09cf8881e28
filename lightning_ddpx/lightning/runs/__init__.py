"""How each strategy runs its processes when fault tolerance is off: the run is chosen once, when the
strategy is built, and the strategy's overrides delegate to it.

- :mod:`.fabric_run`: :class:`FabricRun` and the strategy protocol the runs read (``StrategyView``);
- :mod:`.trainer_run`: :class:`TrainerRun`, Lightning's own behaviour for the Trainer.
"""
