"""A small LightningModule and LightningDataModule on scikit-learn's handwritten digits.

Shared by ``cli_train.py`` (LightningCLI) and ``lightning_demo.py``. The 1797 8x8 images ship inside
scikit-learn, so nothing is downloaded. Both classes are ordinary Lightning code: nothing here knows
about lightning_ddpx, which is the point -- the strategy is a drop-in.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


class DigitsDataModule(LightningDataModule):
    """scikit-learn's digits, pixels scaled to [0, 1], split with every class in both parts.

    Args:
        batch_size: samples per batch and per process.
        val_fraction: share of the images held out for validation.
        split_seed: seed of the train/validation split (independent of the training seed).
    """

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.25, split_seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_train, x_val, y_train, y_val = train_test_split(
            x, y, test_size=self.val_fraction, random_state=self.split_seed, stratify=y
        )

        def as_dataset(features: Any, labels: Any) -> TensorDataset:
            pixels = torch.as_tensor(features, dtype=torch.float32) / 16.0  # values are 0..16
            return TensorDataset(pixels, torch.as_tensor(labels, dtype=torch.int64))

        self.train_set = as_dataset(x_train, y_train)
        self.val_set = as_dataset(x_val, y_val)

    def train_dataloader(self) -> DataLoader:
        # Lightning replaces the sampler with a DistributedSampler: each process sees its own shard.
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class DigitsClassifier(LightningModule):
    """A two-hidden-layer MLP (64 -> hidden -> hidden -> 10) trained with Adam and cross-entropy.

    Args:
        hidden: width of the hidden layers.
        lr: Adam's learning rate.
    """

    def __init__(self, hidden: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )
        self.val_accuracy = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        # torchmetrics accumulates counts on each process and combines them across processes at epoch end.
        self.val_accuracy(logits, y)
        self.log("val_acc", self.val_accuracy, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
