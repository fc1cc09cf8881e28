"""Reference models for benchmarks: their shapes stress different parts of data parallelism.

``mlp`` is bandwidth-bound (few, large gradients), ``transformer`` a realistic mix, ``many`` and ``many1000``
per-parameter overhead (300 and 1,000 small tensors), ``tiny`` only exercises code paths. ``python -m
lightning_ddpx.bench --model mlp`` uses them by name; the scripts in ``benchmarks/`` use the same definitions
(and keep their own targets).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MODELS", "ModelSpec", "build_model"]


class MLP(nn.Sequential):
    """Wide fully connected layers: few, large gradient tensors, so step time is dominated by bandwidth
    (the allreduce of ~80 MB) and by how well communication overlaps the backward pass."""

    def __init__(self, width: int = 2048, layers: int = 5) -> None:
        modules: list[nn.Module] = []
        for i in range(layers):
            modules.append(nn.Linear(width, width))
            if i < layers - 1:
                modules.append(nn.ReLU())
        super().__init__(*modules)


class Encoder(nn.Module):
    """A small ``nn.TransformerEncoder``: a realistic mix of matrix and vector parameters (48 tensors).

    Dropout is 0 so that the run is deterministic: both contenders do bit-identical arithmetic, and the
    benchmark can check that their parameters still agree at the end (proof that they did the same work).
    """

    def __init__(self, d_model: int = 256, nhead: int = 8, num_layers: int = 4, dim_feedforward: int = 1024):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


class ManySmall(nn.Module):
    """Many small residual layers: ~300 parameter tensors of ~13k elements each (~2M parameters).

    Per-parameter bookkeeping dominates here, not arithmetic or bandwidth, which is exactly where a Python
    reducer pays for itself (a hook call per gradient, per-bucket Python work) - so it is the stress test.
    """

    def __init__(self, width: int = 116, depth: int = 150) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class Tiny(nn.Module):
    """A few-parameter model for smoke tests of the benchmark scripts themselves (no target)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: how to build it and what one rank's batch (and the model's output) looks like."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    target_shape: tuple[int, ...]


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "mlp",
            "MLP 5 x Linear(2048, 2048), ~21M params in 10 tensors, batch 32",
            MLP,
            (32, 2048),
            (32, 2048),
        ),
        ModelSpec(
            "transformer",
            "TransformerEncoder 4 layers, d_model 256, 8 heads, ff 1024, seq 128, batch 8",
            Encoder,
            (8, 128, 256),
            (8, 128, 256),
        ),
        ModelSpec(
            "many",
            "150 residual Linear(116, 116), ~2M params in 300 tensors, batch 32",
            ManySmall,
            (32, 116),
            (32, 116),
        ),
        ModelSpec(
            "many1000",
            "500 residual Linear(64, 64), ~2M params in 1000 tensors, batch 32",
            functools.partial(ManySmall, width=64, depth=500),
            (32, 64),
            (32, 64),
        ),
        ModelSpec("tiny", "Linear(8, 16) + Linear(16, 4), smoke tests only", Tiny, (4, 8), (4, 4)),
    )
}


def build_model(name: str, seed: int = 0) -> nn.Module:
    """A fresh copy of model ``name``; the same ``seed`` gives bit-identical weights (on every rank too)."""
    torch.manual_seed(seed)
    return MODELS[name].build()
