"""Every private name of a dependency that lightning_ddpx uses, quarantined in one module per dependency.

- :mod:`lightning_ddpx._compat.torch`: torch's (autograd engine callback, foreach kernels, c10d internals,
  dynamo/fake-tensor internals for the bucket-aligned compile), for every layer;
- :mod:`lightning_ddpx.lightning._compat`: Lightning's (registries, sync-control base classes, private
  attributes of the Trainer's objects). It lives in the Lightning layer, the only one that may import
  Lightning, so that importing it imports Lightning (and registers our strategy names) before its own body.

Each name carries why we need it and since which version it exists, so an upgrade that breaks one breaks it
here, in one place, and tests/lightning/test_compat.py (which imports and exercises every name) says which. No other
module of the package may import a private name of torch or Lightning (tests/lightning/test_compat.py scans for that)
or touch a private attribute of their objects (``optimizer._optimizer_step_pre_hooks``,
``precision._wrap_closure``: tests/project/test_architecture.py scans for that); a function here does it, and says
which versions it was checked on.
This package imports neither dependency itself.
"""
