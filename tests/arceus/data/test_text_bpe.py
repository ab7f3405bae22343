"""The text dataset with a byte-level BPE vocabulary: trained on the training part only, deterministic,
lossless, and validated where a job declares it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.data.text_config import dataset_tokenizer
from arceus.data.tokenizer import BPE_DEFAULT_VOCAB, split_text, train_bpe
from arceus.errors import SpecError
from arceus.model.registry import fit_model_to_dataset

TEXT = "".join(f"the {w} went to the {v} and the {w} came back. " for w in ("ox", "ass", "lamb")
               for v in ("field", "well", "tent", "city")) * 40


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_training_is_deterministic_and_round_trips_any_text() -> None:
    first, again = train_bpe(TEXT, 300), train_bpe(TEXT, 300)
    assert first.to_json() == again.to_json()
    for text in (TEXT[:500], "héllo ☃ — unseen bytes\n"):
        assert first.decode(first.encode(text)) == text
    assert first.unknown("anything at all ☃") == ""
    assert len(first.encode(TEXT)) < len(TEXT) / 3  # merges learned the repeated words


def test_bpe_windows_are_next_token_pairs_of_the_training_part(source: Path) -> None:
    cfg = validate_dataset_config(
        {"name": "text", "source": str(source), "block_size": 16, "vocab": "bpe", "vocab_size": 300}
    )
    train_x, train_y, val_x, val_y = load_dataset(cfg)
    tokenizer = dataset_tokenizer(cfg)
    train_text, val_text = split_text(TEXT)
    train_ids, val_ids = tokenizer.encode(train_text), tokenizer.encode(val_text)
    assert train_x.shape == ((len(train_ids) - 1) // 16, 16) and val_x.shape == ((len(val_ids) - 1) // 16, 16)
    assert train_x[0].tolist() == train_ids[:16] and val_y[0].tolist() == val_ids[1:17]
    torch.testing.assert_close(train_x[:, 1:], train_y[:, :-1])
    assert int(torch.cat([train_x.flatten(), val_x.flatten()]).max()) < 300
    # Only the training part taught it: the same tokenizer as one trained on that part alone.
    assert tokenizer.encode(val_text) == train_bpe(train_text, 300).encode(val_text)


def test_fit_copies_the_models_bpe_vocabulary_into_the_dataset(source: Path) -> None:
    dataset = validate_dataset_config({"name": "text", "source": str(source)})
    spec, model, dataset = fit_model_to_dataset({"type": "transformer", "vocab": "bpe", "block_size": 16}, dataset)
    assert model["vocab_size"] == spec.vocab_size == BPE_DEFAULT_VOCAB and spec.vocab == "bpe"
    assert dataset["vocab"] == "bpe" and dataset["vocab_size"] == BPE_DEFAULT_VOCAB
    char_dataset = fit_model_to_dataset({"type": "transformer", "block_size": 16}, validate_dataset_config(
        {"name": "text", "source": str(source)}))[2]
    assert "vocab" not in char_dataset and "vocab_size" not in char_dataset  # as stored before BPE existed


@pytest.mark.parametrize(
    ("model_config", "dataset_config", "field", "message"),
    [
        ({"vocab": "wordpiece"}, {}, "model_config.vocab", "must be one of char, bpe"),
        ({"vocab": "bpe", "vocab_size": 100}, {}, "model_config.vocab_size", "between 257 and 65,536"),
        ({"vocab": "bpe", "vocab_size": True}, {}, "model_config.vocab_size", "got True"),
        ({"vocab": "bpe", "vocab_size": 512}, {"vocab": "bpe", "vocab_size": 600}, "dataset_config.vocab_size",
         "is 600 but the model's is 512"),
        ({}, {"vocab": "bpe", "vocab_size": 600}, "dataset_config.vocab", "is 'bpe' but the model's is 'char'"),
    ],
)
def test_bad_vocabularies_name_the_field(
    source: Path, model_config: dict, dataset_config: dict, field: str, message: str
) -> None:
    with pytest.raises(SpecError, match=message) as info:
        fit_model_to_dataset(
            {"type": "transformer", "block_size": 16, **model_config},
            validate_dataset_config({"name": "text", "source": str(source), **dataset_config}),
        )
    assert info.value.field == field


@pytest.mark.parametrize(
    ("dataset_config", "field"),
    [
        ({"vocab": "char", "vocab_size": 40}, "dataset_config.vocab_size"),
        ({"vocab": "bpe"}, "dataset_config.vocab_size"),
        ({"vocab": 3}, "dataset_config.vocab"),
    ],
)
def test_bad_dataset_vocabularies_name_the_field(dataset_config: dict, field: str) -> None:
    with pytest.raises(SpecError) as info:
        validate_dataset_config({"name": "text", **dataset_config})
    assert info.value.field == field
