"""Optimizer steps inside or overlapped with backward, and what runs after them.

- :mod:`.overlap`: ``overlap_optimizer_with``: each bucket's parameters step as soon as it is reduced;
- :mod:`.piecewise_step`: one parameter updated in pieces, as its slices arrive;
- :mod:`.in_backward`: torch's ``_apply_optimizer_in_backward`` optimizers, stepping with the average;
- :mod:`.parameter_averaging`: after the optimizer step, parameters changed across ranks (post-local
  SGD's model averaging, DiLoCo's outer step), and the guard that it runs.
"""
