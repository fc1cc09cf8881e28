"""PowerSGD gradient compression (Vogels et al., 2019), per tensor and batched, with torch's semantics.

- :mod:`.hook`: the two hooks; :mod:`.state`: options, state, checkpointable memory;
- :mod:`.plan`: which gradients are compressed and how they are packed; :mod:`.lowrank`: the matrix maths;
- :mod:`.remap`: memory kept per parameter, so it survives a change of bucket layout;
- :mod:`.state_check`: validation of a loaded ``state_dict``.
"""

from lightning_ddpx.hooks.powersgd.hook import batched_powersgd_hook, powersgd_hook
from lightning_ddpx.hooks.powersgd.state import CompressionStats, PowerSGDOptions, PowerSGDState

# The hooks' public home: checkpoints and the settings check name a callable hook by module and name, and
# that name must not depend on which file inside this package defines it.
for _public in (powersgd_hook, batched_powersgd_hook):
    _public.__module__ = __name__

__all__ = ["CompressionStats", "PowerSGDOptions", "PowerSGDState", "batched_powersgd_hook", "powersgd_hook"]
