"""How a bucket crosses the ranks: the communication hook's call, its ordering, and the paths under it.

- :mod:`.transports`: the path chosen once per reducer (the default mean all-reduce, shared memory, a
  registered hook);
- :mod:`.launcher`: hooks issued in one global order on every rank (a communication thread, or inline);
- :mod:`.cuda_streams`: CUDA stream ordering without host synchronisation;
- :mod:`.shared_memory` and :mod:`.cgroup_memory`: two CPU ranks on one machine sum through shared memory;
- :mod:`.hook_signature` and :mod:`.backend_support`: a hook's signature and bf16 support, checked at
  registration.
"""
