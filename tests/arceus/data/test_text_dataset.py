"""The text dataset: a character vocabulary, a 90/10 split, next-character windows, a seeded order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arceus.data.batches import epoch_batches
from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.data.text_config import BUNDLED_TEXT
from arceus.data.tokenizer import CharTokenizer
from arceus.errors import SpecError
from arceus.model.registry import fit_model_to_dataset


def test_the_bundled_text_is_a_real_book_of_at_least_500_kb() -> None:
    text = BUNDLED_TEXT.read_text(encoding="utf-8")
    assert len(text.encode()) >= 500_000
    assert text.startswith("In the beginning God created the heaven and the earth.")


def test_windows_are_next_character_pairs_split_90_10(tmp_path: Path) -> None:
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
    source = tmp_path / "t.txt"
    source.write_text(text, encoding="utf-8")
    cfg = validate_dataset_config({"name": "text", "source": str(source), "block_size": 10})
    train_x, train_y, val_x, val_y = load_dataset(cfg)
    assert train_x.dtype == train_y.dtype == torch.int64
    assert train_x.shape == (89, 10) and val_x.shape == (9, 10)  # (900 - 1) // 10, (100 - 1) // 10
    tokenizer = CharTokenizer("".join(sorted(set(text))))
    assert tokenizer.decode(train_x[0].tolist()) == text[:10]
    assert tokenizer.decode(train_y[0].tolist()) == text[1:11]
    assert tokenizer.decode(val_x[0].tolist()) == text[900:910]
    torch.testing.assert_close(train_x[:, 1:], train_y[:, :-1])


def test_the_order_is_seeded_so_a_resume_replays_it() -> None:
    cfg = validate_dataset_config({"name": "text", "block_size": 128})
    train_x = load_dataset(cfg)[0]
    assert len(train_x) == 5731
    first = epoch_batches(len(train_x), 32, seed=4, epoch=2)
    again = epoch_batches(len(train_x), 32, seed=4, epoch=2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    torch.testing.assert_close(load_dataset(cfg)[0], train_x)


def test_loading_needs_a_block_size_and_enough_text(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="block_size"):
        load_dataset({"name": "text"})
    source = tmp_path / "short.txt"
    source.write_text("too short", encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_dataset({"name": "text", "source": str(source), "block_size": 8})
    assert info.value.field == "dataset_config.source"


def test_fit_fills_vocab_size_and_block_size() -> None:
    dataset = validate_dataset_config({"name": "text"})
    spec, model, dataset = fit_model_to_dataset({"type": "transformer", "block_size": 64}, dataset)
    assert model["vocab_size"] == spec.vocab_size == 62
    assert dataset["block_size"] == 64
