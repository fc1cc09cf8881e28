"""The two ``DDPXStrategy`` classes: :mod:`.trainer` for ``Trainer(strategy="ddpx")`` and :mod:`.fabric`
for ``Fabric(strategy="ddpx")``. Each picks its run (:mod:`lightning_ddpx.lightning.runs` or
:mod:`lightning_ddpx.lightning.fault_tolerance`) once and delegates to it.
"""
