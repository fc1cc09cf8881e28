"""The Lightning layer: the Trainer strategy, the Fabric strategy and what they share (options, checkpointed
hook state, uneven inputs, post-local SGD set-up, a clean exit). Everything that imports ``lightning``
lives here, so the engine and the hooks can be used without it.
"""

# Lightning first, before any module of this layer starts executing: importing lightning.pytorch registers
# our strategy names (lightning_ddpx/_import_hooks.py), which imports the strategy modules, and they must not
# find one of their own imports half-initialised.
import lightning.pytorch  # noqa: E402, F401
