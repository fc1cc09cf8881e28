"""What the benchmark trains: a built-in model by name, or the user's own ``package.module:factory``.

A factory takes no arguments and returns either a module or ``(module, example_input)``; the example input
(a tensor or a tuple of tensors) is fed unchanged every step. Without one, ``--input-shape`` says what
random batch to feed. The loss is synthetic (mean square of the first output tensor): the benchmark times
communication, not learning, and needs no labels.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lightning_ddpx.bench.models import MODELS

__all__ = ["Workload", "load_workload"]


@dataclass
class Workload:
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]

    def loss(self, model: nn.Module) -> torch.Tensor:
        return first_tensor(model(*self.inputs)).float().square().mean()


def first_tensor(output: Any) -> torch.Tensor:
    """The tensor a synthetic loss is taken from: the output itself, or its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"the model's output has no tensor to take a loss from: {type(output).__name__}")


def _factory(spec: str) -> Callable[[], Any]:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"--model {spec!r}: use a built-in name ({', '.join(MODELS)}) or 'package.module:factory', where "
            "factory() returns a torch.nn.Module or (module, example_input)"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--model {spec!r}: cannot import it ({error})") from error
    if not callable(factory):
        raise ValueError(f"--model {spec!r} is a {type(factory).__name__}, not a callable factory")
    return factory


def load_workload(spec: str, input_shape: tuple[int, ...] | None, seed: int, rank: int) -> Workload:
    """Build the model (the same weights on every rank for one ``seed``) and this rank's input."""
    torch.manual_seed(seed)
    example: Any = None
    if spec in MODELS:
        module = MODELS[spec].build()
        input_shape = input_shape or MODELS[spec].input_shape
    else:
        made = _factory(spec)()
        module, example = made if isinstance(made, tuple) else (made, None)
    if not isinstance(module, nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(module).__name__}, not a torch.nn.Module")
    if example is not None:
        inputs = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    elif input_shape is not None:
        generator = torch.Generator().manual_seed(1_000_003 * seed + rank)
        inputs = (torch.randn(input_shape, generator=generator),)
    else:
        raise ValueError(
            f"--model {spec!r}: the factory returned no example input; pass --input-shape (e.g. 32,1024) or "
            "return (module, example_input) from the factory"
        )
    return Workload(module, inputs)
