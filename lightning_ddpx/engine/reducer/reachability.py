"""Which parameters can receive a gradient from a forward's outputs (for ``find_unused_parameters``).

A parameter that forward did not use never fires its gradient hook, so its bucket would wait forever.
Walking the autograd graph back from the outputs finds every parameter that *can* get a gradient; the
rest are marked ready (with a zero contribution) as soon as backward starts.
"""

from __future__ import annotations

import warnings
from dataclasses import fields, is_dataclass
from typing import Any, Iterator, Mapping

import torch

__all__ = ["iter_tensors", "reachable_parameter_indices", "unreachable_parameter_indices"]

_warned_nothing_unused = False  # torch warns once per process


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``: tensors, lists, tuples (named or not), mappings and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from iter_tensors(item)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for field in fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def reachable_parameter_indices(outputs: Any, index_of: Mapping[int, int]) -> set[int]:
    """Indices (values of ``index_of``, keyed by ``id(param)``) of parameters reachable from ``outputs``."""
    reached: set[int] = set()
    pending = []
    for tensor in iter_tensors(outputs):
        if tensor.grad_fn is not None:
            pending.append(tensor.grad_fn)
        elif tensor.requires_grad and id(tensor) in index_of:  # forward returned a parameter itself
            reached.add(index_of[id(tensor)])
    seen = set(pending)
    while pending:
        node = pending.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            index = index_of.get(id(variable))
            if index is not None:
                reached.add(index)
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                pending.append(next_node)
    return reached


def unreachable_parameter_indices(outputs: Any, index_of: Mapping[int, int]) -> set[int]:
    """The parameters ``outputs`` cannot reach (they will get no gradient in this backward). When there are
    none, warn once per process, as torch's reducer does: the graph walk of ``find_unused_parameters`` then
    costs time every step for nothing, unless later iterations skip parameters."""
    global _warned_nothing_unused
    unreachable = set(index_of.values()) - reachable_parameter_indices(outputs, index_of)
    if not unreachable and not _warned_nothing_unused:
        _warned_nothing_unused = True
        warnings.warn(
            "lightning_ddpx.DistributedDataParallel: find_unused_parameters=True was given, but this forward "
            "used every parameter. The flag walks the autograd graph every iteration, which costs time: if no "
            "iteration ever leaves a parameter unused, turn it off (strategy 'ddpx' rather than "
            "'ddpx_find_unused_parameters_true'). (torch: find_unused_parameters=True was specified in DDP "
            "constructor, but did not find any unused parameters in the forward pass.)",
            stacklevel=2,
        )
    return unreachable
