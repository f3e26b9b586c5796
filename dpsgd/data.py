"""Datasets and their partition across peers.

`load(cfg)` returns a fixed train/test split as tensors; `partition(...)` gives each peer an
equal share of the training set (equal shares, so an all-reduce of mean gradients is exactly
large-batch SGD). Everything is seeded: the same seed gives the same split on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DATASETS = ("digits",)


@dataclass
class Split:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load(name: str, test_fraction: float = 0.2, seed: int = 0) -> Split:
    """A dataset with a held-out test split fixed by `seed` (stratified by class)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"data.test_fraction must be in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)  # pixel intensities 0..16 -> [0, 1]
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    t = torch.from_numpy
    return Split(t(x_tr), t(y_tr).long(), t(x_te), t(y_te).long(), num_classes=10)


def partition(num_samples: int, peers: int, seed: int) -> list[np.ndarray]:
    """IID partition: a seeded shuffle cut into `peers` equal shares (the remainder is dropped)."""
    share = num_samples // peers
    if share < 1:
        raise ValueError(f"{num_samples} training samples cannot be split among {peers} peers; use fewer peers")
    order = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(order[r * share : (r + 1) * share]) for r in range(peers)]


class Batches:
    """Endless minibatches of one peer's share, reshuffled each epoch by the peer's own
    generator (threads of the local backend must not share torch's global RNG)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
        if batch_size < 1 or batch_size > len(x):
            raise ValueError(f"batch_size must be in [1, {len(x)}] (the samples per peer), got {batch_size}")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.steps_per_epoch = len(x) // batch_size
        self._gen = torch.Generator().manual_seed(seed)
        self._order = None
        self.position = 0  # batches drawn so far

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.position % self.steps_per_epoch
        if i == 0:
            self._order = torch.randperm(len(self.x), generator=self._gen)
        idx = self._order[i * self.batch_size : (i + 1) * self.batch_size]
        self.position += 1
        return self.x[idx], self.y[idx]
