"""The Lightning layer: the Trainer strategy, the Fabric strategy and what they share (options, checkpointed
hook state, uneven inputs, post-local SGD set-up, a clean exit). Everything that imports ``lightning``
lives here, so the engine and the hooks can be used without it.
"""
