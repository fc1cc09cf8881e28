"""What a checkpoint holds beyond Lightning's own, and writes a killed process cannot tear.

- :mod:`.checkpoint_io`: :class:`AtomicCheckpointIO`, a checkpoint written whole or not at all;
- :mod:`.checkpoint_state`: every rank's communication-hook state, in one file that loads with
  ``weights_only=True``;
- :mod:`.local_replicas`: every rank's own weights and optimizer state while post-local SGD lets them differ.
"""
