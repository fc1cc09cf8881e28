"""The options both ``DDPXStrategy`` classes take: declared once, checked by type and range, turned into a
model.

- :mod:`.options`: every option beyond Lightning's own arguments, declared once for both strategies;
- :mod:`.config`: :class:`DDPXConfig`, the checked options and what they do to a model (hooks included);
- :mod:`.ddp_kwargs`: Lightning's ``DDPStrategy`` and torch's DDP keyword arguments mapped onto ours;
- :mod:`.fault_tolerance_options`: the options fault tolerance cannot follow, refused by name.
"""
