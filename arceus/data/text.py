"""The `text` dataset: the text tokenized (characters or BPE, see arceus.data.tokenizer), a 90/10
train/validation split by characters, and non-overlapping windows of `block_size` tokens (x) with the
next tokens as targets (y).

Windows are fixed by the file, the vocabulary and `block_size` only, so `epoch_batches` orders them by
the seed exactly as it orders digits or MNIST samples, and a resumed run replays the same data.
"""

from __future__ import annotations

from typing import Any

import torch

from arceus.data.sources import Split
from arceus.data.text_config import dataset_tokenizer, text_path
from arceus.data.tokenizer import read_text, split_text
from arceus.errors import SpecError


def load_text(cfg: dict[str, Any]) -> Split:
    """(train_x, train_y, val_x, val_y), each int64 [windows, block_size]."""
    if "block_size" not in cfg:
        raise SpecError("dataset_config.block_size", "is required to cut the text into windows")
    block = cfg["block_size"]
    tokenizer = dataset_tokenizer(cfg)
    parts = split_text(read_text(text_path(cfg)))
    windows: list[torch.Tensor] = []
    for part, text in zip(("training", "validation"), parts, strict=True):
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
        if len(ids) <= block:
            raise SpecError(
                "dataset_config.source",
                f"the {part} part of {text_path(cfg)} has {len(ids)} tokens; "
                f"a window of block_size {block} needs more than {block}",
            )
        windows.extend(_windows(ids, block))
    train_x, train_y, val_x, val_y = windows
    return train_x, train_y, val_x, val_y


def _windows(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = (len(ids) - 1) // block
    return ids[: n * block].view(n, block), ids[1 : n * block + 1].view(n, block)
