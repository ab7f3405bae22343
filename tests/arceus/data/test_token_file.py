"""An uploaded text's token file (arceus.data.token_file): its documented layout, written from the text streamed in
bounded pieces, keyed by what its tokens depend on, and refused when it is not what was written."""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from arceus.data.formats import CHUNK_BYTES, inspect_file
from arceus.data.token_file import (
    HEADER_BYTES,
    TokenFileError,
    text_pieces,
    token_counts,
    token_file_key,
    tokens_write,
)
from arceus.data.tokenizer import CharTokenizer, split_text

DATASET_ID = "00000000-0000-4000-8000-000000000001"
TOKENIZER_ID = "00000000-0000-4000-8000-000000000002"


def text_config(text: str, **extra: Any) -> dict[str, Any]:
    facts = inspect_file(io.BytesIO(text.encode()), len(text.encode()), "text", "text")
    return {"name": "text", "dataset_id": DATASET_ID, "format": "text", "batch_size": 4, **facts, **extra}


def written(cfg: dict[str, Any], text: str, **kwargs: Any) -> bytes:
    out = io.BytesIO()
    tokens_write(cfg, io.BytesIO(text.encode()), out, **kwargs)
    return out.getvalue()


def test_the_token_file_is_its_documented_layout() -> None:
    text = "".join(f"line {i}: ünïcode and plain words\n" for i in range(300))
    data = written(text_config(text), text)
    magic, train, validation, itemsize, vocab = struct.unpack("<8sQQII", data[:32])
    char = CharTokenizer("".join(sorted(set(text))))
    parts = [char.encode(part) for part in split_text(text)]
    assert (magic, train, validation, itemsize, vocab) == (b"ARCTOK01", *map(len, parts), 2, char.vocab_size)
    assert HEADER_BYTES == 32 and len(data) == 32 + 2 * (train + validation)
    assert np.frombuffer(data[32:], dtype="<u2").tolist() == parts[0] + parts[1]
    counts = token_counts(io.BytesIO(data), len(data))
    assert (counts.train, counts.validation, counts.dtype, counts.size) == (train, validation, "uint16", len(data))


def test_a_vocabulary_past_65536_ids_is_written_as_int32(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer.to_str())
    text = "".join(f"w{i * 997 % 70_000} w69999\n" for i in range(200))
    data = written(text_config(text, tokenizer_id=TOKENIZER_ID, vocab="bpe", vocab_size=70_000), text,
                   open_tokenizer=lambda: path.open("rb"))
    counts = token_counts(io.BytesIO(data), len(data))
    assert (counts.itemsize, counts.vocab_size) == (4, 70_000)
    ids = np.frombuffer(data[HEADER_BYTES:], dtype="<i4")
    assert int(ids.max()) == 69_999 and ids[:2].tolist() == [0, 69_999]


def test_a_lineless_text_streams_in_bounded_pieces_cut_at_the_training_mark() -> None:
    text = "ab" * (3 * CHUNK_BYTES // 2)  # 3 MiB of characters without a line end
    cfg = text_config(text)
    pieces = list(text_pieces(cfg, io.BytesIO(text.encode()), train_only=False))
    assert max(len(p) for _, p in pieces) <= 2 * CHUNK_BYTES
    train = "".join(p for part, p in pieces if part == "training")
    assert (train, "".join(p for _, p in pieces)) == (split_text(text)[0], text)


def test_the_key_names_what_the_tokens_depend_on() -> None:
    assert token_file_key({"dataset_id": DATASET_ID}) == "char"
    assert token_file_key({"dataset_id": DATASET_ID, "vocab": "bpe", "vocab_size": 300}) == "bpe-300"
    assert token_file_key({"vocab": "bpe", "vocab_size": 512, "tokenizer_id": TOKENIZER_ID}) == (
        f"tokenizer-{TOKENIZER_ID}"
    )


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: b"NOTTOKEN" + d[8:], "not a token file"),
    (lambda d: d[:-2], "the header says"),
    (lambda d: d[:24] + struct.pack("<II", 3, 10) + d[32:], "is not a layout"),
    (lambda d: d[:24] + struct.pack("<II", 2, 70_000) + d[32:], "is not a layout"),
    (lambda d: d[:10], "no 32-byte header"),
])
def test_a_file_that_is_not_a_token_file_is_refused(change: Any, message: str) -> None:
    text = "tokens and more tokens\n" * 40
    data = change(written(text_config(text), text))
    with pytest.raises(TokenFileError, match=message):
        token_counts(io.BytesIO(data), len(data))
