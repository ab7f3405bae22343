"""The samples stage 0 and the last stage read themselves: which datasets, and the same rows as the driver's."""

from __future__ import annotations

import json

import pytest
import torch

from arceus.data.batches import epoch_batches
from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.data.step_data import (
    LocalDatasets,
    checked_indices,
    labels_per_sample,
    micro_batch_indices,
    stages_read,
)
from arceus.errors import SpecError

DIGITS = validate_dataset_config({"name": "digits", "batch_size": 32})


def test_only_bundled_datasets_without_a_path_are_read_by_the_stages() -> None:
    assert stages_read(DIGITS)
    assert stages_read({"name": "text", "block_size": 8})
    assert not stages_read({"name": "text", "block_size": 8, "source": "book.txt"})
    assert not stages_read({"name": "MNIST"})
    assert not stages_read({"name": "uploaded", "dataset_id": "a" * 32})


def test_a_text_window_counts_a_loss_term_per_position() -> None:
    assert labels_per_sample(DIGITS) == 1
    assert labels_per_sample({"name": "text", "block_size": 16}) == 16


def test_a_stage_reads_the_rows_the_driver_would_push() -> None:
    train_x, train_y, val_x, val_y = load_dataset(DIGITS)
    datasets = LocalDatasets()
    indices = epoch_batches(len(train_x), 32, seed=3, epoch=2)[5]
    x, y = datasets.split(json.dumps(DIGITS), validation=False)
    for mine, pushed in zip(micro_batch_indices(indices, 3), torch.tensor_split(train_x[indices], 3), strict=True):
        assert torch.equal(x[mine], pushed)
    assert torch.equal(y[indices], train_y[indices])
    vx, vy = datasets.split(json.dumps(DIGITS), validation=True)
    assert torch.equal(vx, val_x) and torch.equal(vy, val_y)


@pytest.mark.parametrize(
    ("dataset_json", "field", "fragment"),
    [
        ("{", "data.dataset_json", "is not JSON"),
        (json.dumps({"name": "uploaded", "dataset_id": "a" * 32}), "data.dataset_json", "only with its layout"),
        (json.dumps({"name": "digits", "batch_size": 0}), "dataset_config.batch_size", ""),
    ],
)
def test_a_dataset_the_stages_cannot_read_is_refused_naming_the_field(
    dataset_json: str, field: str, fragment: str
) -> None:
    with pytest.raises(SpecError) as info:
        LocalDatasets().split(dataset_json, validation=False)
    assert info.value.field.startswith(field) and fragment in info.value.message


def test_indices_outside_the_split_are_refused() -> None:
    assert torch.equal(checked_indices([0, 4, 9], 10), torch.tensor([0, 4, 9]))
    for bad in (10, -1):
        with pytest.raises(SpecError, match=f"index {bad} is outside the split's 10 samples"):
            checked_indices([0, bad], 10)
