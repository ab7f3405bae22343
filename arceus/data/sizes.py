"""How many training samples a validated dataset config gives, torch-free (the control plane's estimates count
them without loading a dataset into tensors; a test holds the counts to what `arceus.data.loader` loads)."""

from __future__ import annotations

import gzip
from typing import Any

from arceus.data.config import idx_file, mnist_dir
from arceus.data.text_config import TEXT_DATASET, dataset_tokenizer, text_path
from arceus.data.tokenizer import TRAIN_FRACTION, read_text, split_text

# An uploaded dataset's first 90% of rows (a text's, of characters) train; the rest validate.
UPLOADED_TRAIN_FRACTION = 0.9
DIGITS_SAMPLES = 1797  # sklearn's bundled 8x8 digits; the first fifth (of a seeded permutation) validates


def train_samples_estimate(cfg: dict[str, Any]) -> int:
    """How many training samples a validated config gives, without reading an upload (a BPE text's windows are
    estimated as its characters')."""
    if "dataset_id" in cfg:
        if cfg.get("kind") == "tensors":
            return int(cfg["samples"] * UPLOADED_TRAIN_FRACTION)
        return int(cfg["characters"] * TRAIN_FRACTION) // cfg["block_size"]
    if cfg["name"] == TEXT_DATASET:
        # Non-overlapping windows of block_size tokens, each with its next-token targets (`arceus.data.text`).
        tokens = len(dataset_tokenizer(cfg).encode(split_text(read_text(text_path(cfg)))[0]))
        return max(0, (tokens - 1) // cfg["block_size"])
    if cfg["name"] == "MNIST":
        return _idx_count(mnist_dir(cfg), "train-labels-idx1-ubyte")
    return DIGITS_SAMPLES - DIGITS_SAMPLES // 5


def _idx_count(directory: Any, base: str) -> int:
    """The item count an IDX file's header declares (big-endian u32 after the 4-byte magic); 0 if it is absent."""
    path = idx_file(directory, base)
    if path is None:
        return 0
    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as handle:
        return int.from_bytes(handle.read(8)[4:8], "big")
