"""Gradient buckets: which parameters share a flat buffer (planning) and the buffers themselves (storage).

- :mod:`.plan`: pure planning, torch's caps and reverse order (no tensors allocated);
- :mod:`.replanning`: which plan applies when: torch's initial one, the rebuild from the observed gradient
  order, a checkpoint's;
- :mod:`.storage`: the flat buffers, the views into them, the copies in and out;
- :mod:`.grad_bucket`: the object a communication hook receives (torch's ``GradBucket`` surface);
- :mod:`.sparse`: sparse gradients, each in a bucket of its own, as torch's DDP treats them.
"""
