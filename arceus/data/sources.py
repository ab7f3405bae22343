"""The datasets themselves: features float32 in [0, 1], labels int64, as (train_x, train_y, val_x, val_y)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from arceus.data.config import MNIST_FILES, idx_file
from arceus.data.idx import IdxError, read_idx_ubyte

Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
DIGITS_SPLIT_SEED = 0  # fixed: every job sees the same train/val split
MNIST_SIDE = 28


def load_digits() -> Split:
    """sklearn's bundled 8x8 digits (1797 samples), pixels/16; the first fifth of a seeded permutation
    is the validation set."""
    from sklearn.datasets import load_digits as sklearn_digits  # only this dataset needs sklearn

    bunch = sklearn_digits()
    x = torch.from_numpy(np.asarray(bunch.data, dtype=np.float32) / 16.0)
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
    n_val = len(x) // 5
    val, train = perm[:n_val], perm[n_val:]
    return x[train], y[train], x[val], y[val]


def load_mnist(directory: Path) -> Split:
    """MNIST from its four IDX files (each optionally .gz): train → train, t10k → validation."""
    paths = {}
    for base in MNIST_FILES:
        path = idx_file(directory, base)
        if path is None:
            raise FileNotFoundError(f"MNIST file {base} (or {base}.gz) not found in {directory.resolve()}")
        paths[base] = path
    train_x, train_y = _mnist_pair(paths["train-images-idx3-ubyte"], paths["train-labels-idx1-ubyte"])
    val_x, val_y = _mnist_pair(paths["t10k-images-idx3-ubyte"], paths["t10k-labels-idx1-ubyte"])
    return train_x, train_y, val_x, val_y


def _mnist_pair(images_path: Path, labels_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    images = read_idx_ubyte(images_path, ndim=3)
    labels = read_idx_ubyte(labels_path, ndim=1)
    if images.shape[1:] != (MNIST_SIDE, MNIST_SIDE):
        raise IdxError(f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, MNIST's are 28x28")
    if images.shape[0] != labels.shape[0]:
        raise IdxError(
            f"{images_path} holds {images.shape[0]} images but {labels_path} {labels.shape[0]} labels"
        )
    if labels.size and int(labels.max()) > 9:
        raise IdxError(f"{labels_path}: label {int(labels.max())} is not a digit 0-9")
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y
