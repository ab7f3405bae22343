"""Uploaded dataset files: each format checked whole and read a batch at a time (arceus.data.formats, streaming,
uploadable; an uploaded text through the token file the control plane writes once, arceus.data.token_file)."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from arceus.data.formats import DatasetFormatError, inspect_file, text_chunks
from arceus.data.streaming import dataset_samples
from arceus.data.text import load_text
from arceus.data.token_file import tokens_write
from arceus.data.uploadable import uploadable
from arceus.errors import SpecError

DATASET_ID = "00000000-0000-4000-8000-000000000001"


def facts_of(path: Path, fmt: str, column: str = "text") -> dict[str, Any]:
    with path.open("rb") as handle:
        return inspect_file(handle, path.stat().st_size, fmt, column)


def opener(paths: dict[str, Path]):  # noqa: ANN201
    return lambda cfg: paths[cfg["dataset_id"]].open("rb")


def tokenized(path: Path, cfg: dict[str, Any]) -> Path:
    """The token file of the text at `path` for `cfg`, as the control plane writes it (controlplane/datasets)."""
    out = path.with_suffix(".tok")
    with path.open("rb") as text, out.open("w+b") as handle:
        tokens_write(cfg, text, handle)
    return out


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(50, 2, 4, 4, generator=g), torch.randint(0, 3, (50,), generator=g)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


@pytest.mark.parametrize("as_dataset", [False, True], ids=["pair-safetensors", "torch-dataset-npz"])
def test_tensors_convert_check_and_read_back_a_batch_at_a_time(tmp_path: Path, as_dataset: bool) -> None:
    x, y = tensors()
    path, fmt = uploadable(Pairs(x, y) if as_dataset else (x, y), tmp_path)
    assert fmt == ("npz" if as_dataset else "safetensors")
    facts = facts_of(path, fmt)
    assert facts == {"kind": "tensors", "samples": 50, "features": 32, "image_shape": [2, 4, 4], "classes": 3}
    cfg = {"name": "uploaded", "dataset_id": DATASET_ID, "batch_size": 8, "val_batch_size": 8, "format": fmt, **facts}
    with dataset_samples(cfg, opener({DATASET_ID: path})) as (train, val):
        assert (len(train), len(val)) == (45, 5)
        bx, by = train.take(torch.tensor([7, 0, 44]))
        assert torch.equal(bx, x[[7, 0, 44]].reshape(3, -1)) and torch.equal(by, y[[7, 0, 44]])
        vx, vy = val.take(torch.arange(5))
        assert torch.equal(vx, x[45:].reshape(5, -1)) and torch.equal(vy, y[45:])


def test_an_uploaded_text_gives_the_windows_of_the_same_text_on_the_server(tmp_path: Path) -> None:
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {'é' * (i % 3)}\n" for i in range(400))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    facts = facts_of(path, "text")
    assert facts["characters"] == len(text) and facts["vocabulary"] == "".join(sorted(set(text)))
    cfg = {"name": "text", "dataset_id": DATASET_ID, "block_size": 16, "batch_size": 4, "val_batch_size": 4,
           "format": "text", **facts}
    expected = load_text({"name": "text", "source": str(path), "block_size": 16})
    with dataset_samples(cfg, opener({DATASET_ID: tokenized(path, cfg)})) as (train, val):
        assert (len(train), len(val)) == (len(expected[0]), len(expected[2]))
        bx, by = train.take(torch.tensor([3, 0, len(train) - 1]))
        assert torch.equal(bx, expected[0][[3, 0, len(train) - 1]]) and torch.equal(by, expected[1][[3, 0, -1]])
        assert torch.equal(val.take(torch.arange(len(val)))[0], expected[2])


def test_a_bpe_is_trained_on_an_uploaded_texts_training_part(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"word{i % 50} and more words\n" for i in range(3000)), encoding="utf-8")
    cfg = {"name": "text", "dataset_id": DATASET_ID, "block_size": 8, "batch_size": 4, "val_batch_size": 4,
           "vocab": "bpe", "vocab_size": 300, "format": "text", **facts_of(path, "text")}
    with dataset_samples(cfg, opener({DATASET_ID: tokenized(path, cfg)})) as (train, _):
        x, y = train.take(torch.tensor([0, 1]))
        assert x.shape == (2, 8) and int(x.max()) < 300 and torch.equal(x[0, 1:], y[0, :-1])


def test_jsonl_and_parquet_texts_are_their_columns_records_joined_by_newlines(tmp_path: Path) -> None:
    records = ["first record", "second, with ünicode", "third"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"body": r, "id": i}) + "\n" for i, r in enumerate(records)))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": records, "id": [0, 1, 2]}), parquet, row_group_size=2)
    for path, fmt in ((jsonl, "jsonl"), (parquet, "parquet")):
        with path.open("rb") as handle:
            assert "".join(text_chunks(handle, fmt, "body")) == "\n".join(records)
        with pytest.raises(DatasetFormatError, match="text"):
            facts_of(path, fmt)  # no column "text"
    pq.write_table(pa.table({"body": [1, 2]}), parquet)
    with pytest.raises(DatasetFormatError, match="not a string column"):
        facts_of(parquet, "parquet", "body")


def npz_bytes(**arrays: Any) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("fmt", "content", "message"),
    [
        ("text", b"caf\xc3\xa9 \xff", "not UTF-8 at byte 6"),
        ("jsonl", b'{"text": "a"}\n{"txt": "b"}\n', "line 2 has no string field 'text'"),
        ("jsonl", b'{"text": "a"}\nnot json\n', "line 2 is not UTF-8 JSON"),
        ("jsonl", b'{"text": "a"}\n' + b"[" * 5_000 + b"]" * 5_000 + b"\n", "line 2 nests objects and arrays more"),
        ("safetensors", struct.pack("<Q", 10_000) + b"[" * 5_000 + b"]" * 5_000, "header nests objects and arrays"),
        ("parquet", b"PAR1 not really", "not a Parquet file"),
        ("npz", b"PK not a zip", "not an .npz file"),
        ("npz", npz_bytes(x=np.zeros((4, 2), np.float32)), "exactly x.npy and y.npy"),
        ("npz", npz_bytes(x=np.zeros((4, 2), np.float32), y=np.array([object()] * 4)), "no objects"),
        ("npz", npz_bytes(x=np.zeros((4, 2), np.float32), y=np.zeros(3, np.int64)), "one label per sample"),
        ("npz", npz_bytes(x=np.zeros((4, 2), np.float32), y=np.zeros(4, np.float32)), "labels are integers"),
        ("npz", npz_bytes(x=np.zeros((4, 2), np.float32), y=np.zeros(4, np.int64)), "at least 2"),
        ("npz", npz_bytes(x=np.zeros((4, 2), np.float32), y=-np.ones(4, np.int64)), "negative label"),
        ("safetensors", b"\xff" * 16, "header"),
        ("tokenizer", b'{"not": "a tokenizer"}', "not a Hugging Face tokenizer.json"),
    ],
)
def test_a_file_that_is_not_its_format_is_refused_naming_why(tmp_path: Path, fmt: str, content: bytes,
                                                              message: str) -> None:
    path = tmp_path / "bad"
    path.write_bytes(content)
    with pytest.raises(DatasetFormatError, match=message):
        facts_of(path, fmt)


def test_extra_tensors_and_a_compressed_npz_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    save_file({"x": torch.zeros(4, 2), "y": torch.zeros(4, dtype=torch.int64), "z": torch.zeros(1)}, str(path))
    with pytest.raises(DatasetFormatError, match="exactly x and y"):
        facts_of(path, "safetensors")
    path = tmp_path / "d.npz"
    np.savez_compressed(path, x=np.zeros((4, 2), np.float32), y=np.arange(4))
    with pytest.raises(DatasetFormatError, match="savez, not savez_compressed"):
        facts_of(path, "npz")
    with zipfile.ZipFile(path) as archive:
        assert sorted(archive.namelist()) == ["x.npy", "y.npy"]


def test_a_text_too_short_for_its_block_names_the_part(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("tiny text here\n" * 3)
    cfg = {"name": "text", "dataset_id": DATASET_ID, "block_size": 16, "batch_size": 4, "val_batch_size": 4,
           "format": "text", **facts_of(path, "text")}
    tokens = tokenized(path, cfg)
    with pytest.raises(SpecError, match="validation part"), dataset_samples(cfg, opener({DATASET_ID: tokens})):
        pass
