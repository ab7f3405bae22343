from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from arceus.data.batches import epoch_batches
from arceus.data.config import validate_dataset_config
from arceus.data.idx import IdxError, read_idx_ubyte
from arceus.data.loader import load_dataset
from arceus.errors import SpecError


def write_idx(path: Path, array: np.ndarray, *, compress: bool = False, magic: bytes | None = None) -> None:
    header = magic or bytes([0, 0, 0x08, array.ndim])
    data = header + b"".join(struct.pack(">I", d) for d in array.shape) + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def write_mnist(directory: Path, n_train: int = 6, n_val: int = 4, compress: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_val)):
        write_idx(
            directory / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), compress=compress
        )
        write_idx(directory / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10, compress=compress)


# --- digits ---------------------------------------------------------------------------------------
def test_digits_split_is_fixed_and_scaled() -> None:
    train_x, train_y, val_x, val_y = load_dataset({"name": "digits"})
    assert train_x.shape == (1438, 64) and val_x.shape == (359, 64)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    assert float(train_x.min()) >= 0.0 and float(train_x.max()) == 1.0
    again = load_dataset({"name": "Digits", "batch_size": 7})
    assert torch.equal(again[0], train_x) and torch.equal(again[3], val_y)
    # train and validation are disjoint: no validation row appears in the training set
    train_rows = {tuple(row.tolist()) for row in train_x}
    assert sum(tuple(row.tolist()) in train_rows for row in val_x) < 10  # digits has a few exact duplicates


def test_normalize_one_value_for_all_features_and_per_feature() -> None:
    raw = load_dataset({"name": "digits"})[0]
    scaled = load_dataset({"name": "digits", "normalize": {"mean": [0.5], "std": [0.25]}})[0]
    torch.testing.assert_close(scaled, (raw - 0.5) / 0.25)
    means = [float(i) / 64 for i in range(64)]
    per_feature = load_dataset({"name": "digits", "normalize": {"mean": means, "std": [2.0] * 64}})[0]
    torch.testing.assert_close(per_feature, (raw - torch.tensor(means)) / 2.0)


# --- MNIST ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", [False, True])
def test_mnist_from_idx_files(tmp_path: Path, compress: bool) -> None:
    write_mnist(tmp_path, compress=compress)
    train_x, train_y, val_x, val_y = load_dataset({"name": "mnist", "path": str(tmp_path)})
    assert train_x.shape == (6, 784) and val_x.shape == (4, 784)
    assert train_x.dtype == torch.float32 and val_y.dtype == torch.int64
    assert train_y.tolist() == [0, 1, 2, 3, 4, 5]
    assert float(train_x.min()) >= 0.0 and float(train_x.max()) <= 1.0
    raw = read_idx_ubyte(tmp_path / ("train-images-idx3-ubyte" + (".gz" if compress else "")), ndim=3)
    torch.testing.assert_close(train_x[1], torch.from_numpy(raw[1].reshape(-1) / 255.0).float())


def test_mnist_directory_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mnist(tmp_path / "mnist")
    monkeypatch.setenv("ARCEUS_DATA_DIR", str(tmp_path))
    assert validate_dataset_config({"name": "MNIST"})["name"] == "MNIST"
    assert load_dataset({"name": "MNIST"})[0].shape == (6, 784)


def test_missing_mnist_files_are_listed_with_the_directory(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    (tmp_path / "train-images-idx3-ubyte").unlink()
    with pytest.raises(SpecError) as info:
        validate_dataset_config({"name": "MNIST", "path": str(tmp_path)})
    assert info.value.field == "dataset_config.path"
    assert "train-images-idx3-ubyte, t10k-labels-idx1-ubyte" in info.value.message
    assert str(tmp_path.resolve()) in info.value.message


@pytest.mark.parametrize(
    ("magic", "fragment"),
    [
        (bytes([0, 0, 0x09, 3]), "bad magic number 0x00000903; expected 0x00000803"),
        (bytes([0, 0, 0x08, 2]), "bad magic number"),
        (bytes([1, 0, 0x08, 3]), "bad magic number"),
    ],
)
def test_idx_magic_is_checked(tmp_path: Path, magic: bytes, fragment: str) -> None:
    write_idx(tmp_path / "images", np.zeros((2, 28, 28)), magic=magic)
    with pytest.raises(IdxError, match=fragment):
        read_idx_ubyte(tmp_path / "images", ndim=3)


def test_idx_size_must_match_dimensions(tmp_path: Path) -> None:
    write_idx(tmp_path / "labels", np.zeros(5))
    (tmp_path / "labels").write_bytes((tmp_path / "labels").read_bytes()[:-1])
    with pytest.raises(IdxError, match=r"dimensions \[5\] need 13 bytes, file has 12"):
        read_idx_ubyte(tmp_path / "labels", ndim=1)
    (tmp_path / "short").write_bytes(b"\0\0")
    with pytest.raises(IdxError, match="too short"):
        read_idx_ubyte(tmp_path / "short", ndim=1)


def test_mnist_rejects_mismatched_counts_and_sizes(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(5))
    with pytest.raises(IdxError, match="holds 6 images but .* 5 labels"):
        load_dataset({"name": "MNIST", "path": str(tmp_path)})
    write_mnist(tmp_path)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((4, 14, 14)))
    with pytest.raises(IdxError, match="14x14, MNIST's are 28x28"):
        load_dataset({"name": "MNIST", "path": str(tmp_path)})


# --- config validation ----------------------------------------------------------------------------
def test_defaults_are_filled_in() -> None:
    assert validate_dataset_config({"name": "digits"}) == {
        "name": "digits",
        "batch_size": 32,
        "val_batch_size": 256,
    }


@pytest.mark.parametrize(
    ("config", "field", "fragment"),
    [
        ([], "dataset_config", "must be a JSON object"),
        ({}, "dataset_config.name", "is required; one of: digits, MNIST"),
        ({"name": "cifar10"}, "dataset_config.name", "unknown dataset 'cifar10'"),
        ({"name": "digits", "batch_size": 0}, "dataset_config.batch_size", "between 1 and 65536, got 0"),
        ({"name": "digits", "batch_size": 65537}, "dataset_config.batch_size", "between 1 and 65536"),
        ({"name": "digits", "batch_size": True}, "dataset_config.batch_size", "positive integer"),
        ({"name": "digits", "val_batch_size": "8"}, "dataset_config.val_batch_size", "positive integer"),
        ({"name": "digits", "shuffle": True}, "dataset_config.shuffle", "unknown key"),
        ({"name": "digits", "path": "/data"}, "dataset_config.path", "only applies to MNIST"),
        ({"name": "digits", "normalize": [0.5]}, "dataset_config.normalize", '{"mean": [...], "std": [...]}'),
        (
            {"name": "digits", "normalize": {"mean": [0.1], "std": [0.0]}},
            "dataset_config.normalize.std[0]",
            "greater than 0",
        ),
        (
            {"name": "digits", "normalize": {"mean": [0.1, 0.2], "std": [1.0]}},
            "dataset_config.normalize.mean",
            "1 value (for every feature) or 64 (one per feature), got 2",
        ),
        (
            {"name": "digits", "normalize": {"mean": ["x"], "std": [1.0]}},
            "dataset_config.normalize.mean[0]",
            "finite number",
        ),
    ],
)
def test_invalid_dataset_configs(config: object, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        validate_dataset_config(config)
    assert info.value.field == field
    assert fragment in info.value.message


# --- batching -------------------------------------------------------------------------------------
def test_epoch_batches_cover_every_sample_once_and_keep_the_last_partial_batch() -> None:
    batches = epoch_batches(10, 4, seed=1, epoch=1)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(torch.cat(batches).tolist()) == list(range(10))
    assert all(b.dtype == torch.int64 for b in batches)


def test_epoch_batches_depend_on_seed_and_epoch_only() -> None:
    torch.manual_seed(99)
    a = torch.cat(epoch_batches(100, 8, seed=1, epoch=1))
    torch.manual_seed(100)
    assert torch.equal(a, torch.cat(epoch_batches(100, 8, seed=1, epoch=1)))
    assert not torch.equal(a, torch.cat(epoch_batches(100, 8, seed=1, epoch=2)))
    assert not torch.equal(a, torch.cat(epoch_batches(100, 8, seed=2, epoch=1)))
    assert epoch_batches(0, 8, seed=0, epoch=0) == []
