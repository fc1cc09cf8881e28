"""Two real tasks for the convergence benchmark, built from data every machine here already has.

Nothing is downloaded:

* ``digits``: scikit-learn's 1797 handwritten digits (bundled with scikit-learn), upscaled from 8x8 to
  16x16 and classified by a small CNN whose dense layer holds most of its 6.3M parameters.
* ``pydoc-lm``: a word-level causal transformer language model on the English help text that ships inside
  CPython's standard library (``pydoc_data.topics``: ~465k characters, the text of ``help("topics")``),
  scored by next-word accuracy on a held-out tenth. 5.3M parameters (vocabulary 8192, width 256).

Both are sized so that an allreduce of their gradients over an emulated 1 Gbit/s link takes longer than a
step's computation on one CPU core: the regime where gradient compression can pay. Both log ``val_acc``
(higher is better) and ``val_loss`` every validation, and ``train_loss`` every step.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["TASKS", "build_task", "DigitsCNN", "DigitsUpscaled", "PydocLM", "PydocText"]


# ----------------------------------------------------------------------------------------------- digits
class DigitsUpscaled(LightningDataModule):
    """scikit-learn's digits as 1x16x16 images in [0, 1] (bilinear upscaling), a stratified 75/25 split."""

    def __init__(self, batch_size: int = 16, size: int = 16, split_seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.size, self.split_seed = batch_size, size, split_seed

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        images = torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        images = nn.functional.interpolate(images, size=(self.size, self.size), mode="bilinear")
        labels = torch.as_tensor(y, dtype=torch.int64)
        train, val = train_test_split(
            range(len(labels)), test_size=0.25, random_state=self.split_seed, stratify=y
        )
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=512)


class _Classifier(LightningModule):
    """Cross-entropy training with ``train_loss`` per step and ``val_loss`` / ``val_acc`` per validation."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self._logits(x), y.reshape(-1))
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits, y = self._logits(x), y.reshape(-1)
        # Sums, not means, so the value over both ranks' shards is exact whatever the shard sizes.
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, batch_size=len(y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True, batch_size=len(y))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).reshape(-1, self.num_classes)


class DigitsCNN(_Classifier):
    """conv(1->32) -> pool -> conv(32->64) -> dense(4096 -> ``hidden``) -> 10, SGD with momentum.

    Args:
        hidden: width of the dense layer (6.3M parameters at 1536).
        lr: SGD learning rate (momentum 0.9).
    """

    num_classes = 10

    def __init__(self, hidden: int = 1536, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(64 * 8 * 8, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


# ------------------------------------------------------------------------------------------- pydoc-lm
# Words, numbers, and punctuation marks with a run of the same mark ("-----" in reST tables) as one.
_WORD = re.compile(r"[A-Za-z_]+|[0-9]+|([^\sA-Za-z_0-9])\1*")


def pydoc_tokens() -> list[str]:
    """The stdlib's help topics as lower-cased words and punctuation marks, topics in sorted order."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[name] for name in sorted(topics))
    return [(m.group(1) or m.group(0)).lower() for m in _WORD.finditer(text)]


class _Windows(Dataset):
    """Non-overlapping windows of ``context + 1`` token ids: input is the first ``context``, target the rest."""

    def __init__(self, ids: torch.Tensor, context: int) -> None:
        self.ids, self.context = ids, context

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.context
        return self.ids[start : start + self.context], self.ids[start + 1 : start + self.context + 1]


class PydocText(LightningDataModule):
    """Word ids of ``pydoc_data.topics``: the ``vocab - 1`` most frequent words plus ``<unk>`` (id 0).

    The last tenth of the text (by position) is the validation set; the vocabulary is counted on the
    first nine tenths only.
    """

    def __init__(self, batch_size: int = 4, context: int = 32, vocab: int = 8192) -> None:
        super().__init__()
        self.batch_size, self.context, self.vocab = batch_size, context, vocab

    def setup(self, stage: str) -> None:
        tokens = pydoc_tokens()
        cut = len(tokens) * 9 // 10
        common = collections.Counter(tokens[:cut]).most_common(self.vocab - 1)
        index = {word: i + 1 for i, (word, _) in enumerate(common)}
        ids = torch.tensor([index.get(t, 0) for t in tokens], dtype=torch.int64)
        self.train_set = _Windows(ids[:cut], self.context)
        self.val_set = _Windows(ids[cut:], self.context)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class PydocLM(_Classifier):
    """Word embedding + learned positions -> ``layers`` causal pre-norm transformer layers -> vocabulary.

    Args:
        vocab: vocabulary size (must match :class:`PydocText`).
        width: model width; feed-forward width is twice this.
        layers: transformer layers.
        context: longest sequence (positions learned).
        lr: AdamW learning rate.
    """

    def __init__(
        self, vocab: int = 8192, width: int = 256, layers: int = 2, context: int = 32, lr: float = 2e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_classes = vocab
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(context)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        h = self.embed(ids) + self.position[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.out(self.norm(h))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)


# ------------------------------------------------------------------------------------------- registry
TASKS: dict[str, tuple[type[LightningModule], type[LightningDataModule]]] = {
    "digits": (DigitsCNN, DigitsUpscaled),
    "pydoc-lm": (PydocLM, PydocText),
}


def build_task(name: str, **model_kwargs: Any) -> tuple[LightningModule, LightningDataModule]:
    """A fresh ``(LightningModule, LightningDataModule)`` of a built-in task."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose from {', '.join(TASKS)} or pass an import path")
    module_cls, data_cls = TASKS[name]
    return module_cls(**model_kwargs), data_cls()
