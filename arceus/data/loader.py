"""Load the dataset a validated `dataset_config` names, with its optional normalisation applied."""

from __future__ import annotations

from typing import Any

import torch

from arceus.data.config import mnist_dir, validate_dataset_config
from arceus.data.sources import Split, load_digits, load_mnist
from arceus.data.text import load_text
from arceus.data.text_config import TEXT_DATASET


def load_dataset(cfg: dict[str, Any]) -> Split:
    """(train_x float32 [N, F], train_y int64 [N], val_x, val_y) for the dataset `cfg` names; for text,
    x and y are int64 [N, block_size] windows."""
    cfg = validate_dataset_config(cfg)
    if cfg["name"] == TEXT_DATASET:
        return load_text(cfg)
    train_x, train_y, val_x, val_y = load_mnist(mnist_dir(cfg)) if cfg["name"] == "MNIST" else load_digits()
    if "normalize" in cfg:
        mean = torch.tensor(cfg["normalize"]["mean"], dtype=torch.float32)
        std = torch.tensor(cfg["normalize"]["std"], dtype=torch.float32)
        train_x, val_x = (train_x - mean) / std, (val_x - mean) / std
    return train_x, train_y, val_x, val_y
