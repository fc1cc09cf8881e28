"""The Lightning layer: the Trainer strategy, the Fabric strategy and what they share. Everything that
imports ``lightning`` lives here, so the engine and the hooks can be used without it.

Rooms, each importing only the rooms listed before it (``tests/project/test_architecture.py`` keeps this order):

1. leaf modules: :mod:`._compat` (the private Lightning names we use, and since which version);
2. :mod:`.checkpoints`: what a checkpoint holds beyond Lightning's own (every rank's hook state, every
   rank's replica under post-local SGD) and writes a killed process cannot tear;
3. :mod:`.features`: one module per feature both strategies set up the same way (DiLoCo, post-local SGD,
   the optimizer in backward, compile, uneven inputs, replica verification);
4. :mod:`.processes`: starting, joining and ending the processes (the popen launcher that names a lost
   process, torchrun's restarts, a clean exit);
5. :mod:`.settings`: the options both strategies take, declared once, checked and turned into a model;
6. :mod:`.runs`: how each strategy runs its processes when fault tolerance is off, chosen once at
   construction;
7. :mod:`.fault_tolerance`: the fault-tolerant runs (a lost rank does not end ``fit``), their launcher,
   metric syncs and the state a heal proves equal;
8. :mod:`.strategies`: the two ``DDPXStrategy`` classes, Trainer and Fabric, which delegate to their run.
"""

# Lightning first, before any module of this layer starts executing: importing lightning.pytorch registers
# our strategy names (lightning_ddpx/_import_hooks.py), which imports the strategy modules, and they must not
# find one of their own imports half-initialised.
import lightning.pytorch  # noqa: E402, F401
