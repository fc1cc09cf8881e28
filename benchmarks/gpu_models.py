"""The GPU benchmark's models, each in a full size (for a GPU) and a tiny one (the CPU dry run).

Where the GPU sets the pace (each timed step ends with a synchronisation):

- ``resnet50``: a ResNet-50-like CNN (bottleneck blocks 3-4-6-3, widths 64-2048, BatchNorm, 1,000 classes;
  ~25.6M parameters in 161 tensors): many mid-sized gradients, BatchNorm buffers broadcast every forward;
- ``gpt2``: a GPT-2-small-like decoder (12 blocks, d_model 768, 12 heads, vocabulary 50,257, context 1,024,
  input and output embeddings tied; ~124M parameters): few large gradients, one of 154 MB.

Where the CPU sets the pace (*launch-bound*: the GPU finishes its kernels faster than Python issues them, so
every microsecond of host work is step time; timed free-running, ``GpuModel.free_running``):

- ``mlp``: 64 x ``Linear(512, 512)`` + ReLU, batch 16, AdamW: 128 gradients in 4 buckets;
- ``lm``: a 6-layer, 512-wide causal transformer LM under bf16 autocast, batch 8 x 128 tokens, AdamW.

Synthetic data, made once per rank (data loading is not what is measured). Written here rather than taken
from torchvision or transformers, which the project does not depend on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPU_MODELS", "GpuModel", "GPT2Like", "ResNet50Like"]


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1 reduce, 3x3 (strided), 1x1 expand, each with BatchNorm; a projected
    shortcut where the shape changes."""

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        outputs = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, outputs, 1, bias=False), nn.BatchNorm2d(outputs),
        )  # fmt: skip
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50Like(nn.Module):
    """ResNet-50's layout (``blocks`` per stage, ``base`` channels in the first stage, doubling per stage)."""

    def __init__(self, base: int = 64, blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(base), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        ]  # fmt: skip
        inputs = base
        for stage, count in enumerate(blocks):
            width = base * 2**stage
            for block in range(count):
                layers.append(Bottleneck(inputs, width, stride=2 if stage > 0 and block == 0 else 1))
                inputs = 4 * width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class Block(nn.Module):
    """A pre-norm GPT-2 block: causal self-attention and a 4x GELU MLP, each added to the residual stream."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d_model = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d_model, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, d_model))
        return x + self.mlp(self.ln2(x))


class GPT2Like(nn.Module):
    """GPT-2's layout: token and position embeddings, ``layers`` blocks, a final LayerNorm, and the output
    projection tied to the token embedding (one parameter used twice, as in GPT-2)."""

    def __init__(
        self, vocab: int = 50257, context: int = 1024, d_model: int = 768, layers: int = 12, heads: int = 12
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def deep_mlp(width: int, layers: int) -> nn.Module:
    """``layers`` x (``Linear(width, width)`` + ReLU): many small gradients, little arithmetic per step."""
    return nn.Sequential(*[module for _ in range(layers) for module in (nn.Linear(width, width), nn.ReLU())])


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class GpuModel:
    """One model of the GPU benchmark: how to build it, one rank's batch, its loss, its optimizer, and how
    it is timed."""

    description: str
    build: Callable[[bool], nn.Module]  # tiny -> model
    batch: Callable[[bool, torch.Generator], Batch]  # tiny, generator -> (inputs, target) on the CPU
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str = "sgd"  # "sgd" (lr 1e-3) or "adamw" (torch's default foreach implementation)
    autocast: torch.dtype | None = None  # forward under torch.autocast with this dtype
    # Launch-bound: steps are timed in runs of ``free_running`` without a synchronisation between them (one
    # at the end of the run), as a training loop runs; 0: every step ends with one (the GPU sets the pace).
    free_running: int = 0


def _images(tiny: bool, generator: torch.Generator) -> Batch:
    size, count, classes = (32, 2, 10) if tiny else (160, 32, 1000)
    images = torch.randn(count, 3, size, size, generator=generator)
    return images, torch.randint(classes, (count,), generator=generator)


def _tokens(tiny: bool, generator: torch.Generator) -> Batch:
    vocab, count, length = (128, 2, 16) if tiny else (50257, 8, 512)
    tokens = torch.randint(vocab, (count, length + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _vectors(tiny: bool, generator: torch.Generator) -> Batch:
    width, count = (16, 4) if tiny else (512, 16)
    return torch.randn(count, width, generator=generator), torch.randn(count, width, generator=generator)


def _short_tokens(tiny: bool, generator: torch.Generator) -> Batch:
    vocab, count, length = (128, 2, 16) if tiny else (8192, 8, 128)
    tokens = torch.randint(vocab, (count, length + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


GPU_MODELS: dict[str, GpuModel] = {
    "resnet50": GpuModel(
        "ResNet-50-like CNN, ~25.6M params in 161 tensors, batch 32 x 3 x 160 x 160, 1000 classes",
        lambda tiny: ResNet50Like(base=8, blocks=(1, 1, 1, 1), classes=10) if tiny else ResNet50Like(),
        _images,
        F.cross_entropy,
    ),
    "gpt2": GpuModel(
        "GPT-2-small-like decoder, ~124M params (tied embeddings), batch 8 x 512 tokens",
        lambda tiny: GPT2Like(vocab=128, context=16, d_model=32, layers=2, heads=4) if tiny else GPT2Like(),
        _tokens,
        _next_token_loss,
    ),
    "mlp": GpuModel(
        "launch-bound: 64 x Linear(512, 512) + ReLU, 128 tensors, batch 16, AdamW, free-running",
        lambda tiny: deep_mlp(16, 8) if tiny else deep_mlp(512, 64),
        _vectors,
        F.mse_loss,
        optimizer="adamw",
        free_running=10,
    ),
    "lm": GpuModel(
        "launch-bound: 6-layer 512-wide causal LM, bf16 autocast, batch 8 x 128 tokens, AdamW, free-running",
        lambda tiny: (
            GPT2Like(vocab=128, context=16, d_model=32, layers=2, heads=4)
            if tiny
            else GPT2Like(vocab=8192, context=128, d_model=512, layers=6, heads=8)
        ),
        _short_tokens,
        _next_token_loss,
        optimizer="adamw",
        autocast=torch.bfloat16,
        free_running=10,
    ),
}
