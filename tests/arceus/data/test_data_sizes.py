"""The torch-free training-sample counts are what the loader loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.data.sizes import train_samples_estimate
from tests.arceus.data.test_data_datasets import write_mnist


@pytest.mark.parametrize(
    "config",
    [
        {"name": "digits"},
        {"name": "text", "block_size": 16},
        {"name": "text", "block_size": 7, "vocab": "bpe", "vocab_size": 300},
    ],
    ids=["digits", "text", "text-bpe"],
)
def test_a_built_in_datasets_count_is_what_loads(config: dict) -> None:
    cfg = validate_dataset_config(config)
    assert train_samples_estimate(cfg) == len(load_dataset(cfg)[0])


@pytest.mark.parametrize("compress", [False, True])
def test_mnists_count_is_its_training_files(tmp_path: Path, compress: bool) -> None:
    write_mnist(tmp_path, n_train=7, compress=compress)
    cfg = validate_dataset_config({"name": "MNIST", "path": str(tmp_path)})
    assert train_samples_estimate(cfg) == len(load_dataset(cfg)[0]) == 7
