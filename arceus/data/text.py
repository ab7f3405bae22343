"""The `text` dataset: a character vocabulary from the file, a 90/10 train/validation split, and
non-overlapping windows of `block_size` characters (x) with the next characters as targets (y).

Windows are fixed by the file and `block_size` only, so `epoch_batches` orders them by the seed exactly
as it orders digits or MNIST samples, and a resumed run replays the same data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from arceus.data.sources import Split
from arceus.data.text_config import text_path
from arceus.errors import SpecError

TRAIN_FRACTION = 0.9


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("dataset_config.source", f"cannot read {path} as UTF-8 text: {exc}") from exc


def char_vocabulary(text: str) -> str:
    """Every distinct character, sorted: token i is vocabulary[i]."""
    return "".join(sorted(set(text)))


def text_vocabulary(cfg: dict[str, Any]) -> str:
    """The character vocabulary of the text a validated `text` dataset config names."""
    return char_vocabulary(read_text(text_path(cfg)))


def encode(text: str, vocabulary: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(vocabulary)}
    try:
        return torch.tensor([index[c] for c in text], dtype=torch.int64)
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None


def decode(ids: list[int], vocabulary: str) -> str:
    return "".join(vocabulary[i] for i in ids)


def load_text(cfg: dict[str, Any]) -> Split:
    """(train_x, train_y, val_x, val_y), each int64 [windows, block_size]."""
    if "block_size" not in cfg:
        raise SpecError("dataset_config.block_size", "is required to cut the text into windows")
    block = cfg["block_size"]
    text = read_text(text_path(cfg))
    ids = encode(text, char_vocabulary(text))
    cut = int(len(ids) * TRAIN_FRACTION)
    train, val = ids[:cut], ids[cut:]
    for part, ids_part in (("training", train), ("validation", val)):
        if len(ids_part) <= block:
            raise SpecError(
                "dataset_config.source",
                f"the {part} part of {text_path(cfg)} has {len(ids_part)} characters; "
                f"a window of block_size {block} needs more than {block}",
            )
    return (*_windows(train, block), *_windows(val, block))


def _windows(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = (len(ids) - 1) // block
    return ids[: n * block].view(n, block), ids[1 : n * block + 1].view(n, block)
