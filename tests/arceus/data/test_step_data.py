"""The samples stage 0 and the last stage read themselves: which datasets, and the same rows as the driver's."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from arceus.data.batches import epoch_batches
from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.data.sources import Split
from arceus.data.step_data import (
    BUNDLED_DATASETS,
    LocalDatasets,
    checked_indices,
    labels_per_sample,
    micro_batch_indices,
    stages_read,
)
from arceus.data.streaming import dataset_samples
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


class CountedLoads:
    """load_dataset, counting its calls."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, cfg: dict) -> Split:
        self.count += 1
        return load_dataset(cfg)


def test_threads_asking_at_once_share_one_load() -> None:
    loads = CountedLoads()
    datasets, ready = LocalDatasets(load=loads), threading.Barrier(8)

    def ask(batch_size: int) -> Split:
        ready.wait()  # every thread asks at once
        return datasets.loaded(validate_dataset_config({"name": "digits", "batch_size": batch_size}))

    with ThreadPoolExecutor(8) as pool:
        splits = list(pool.map(ask, range(1, 9)))  # batch sizes differ: the samples do not
    assert loads.count == 1
    assert all(s[0] is splits[0][0] and s[3] is splits[0][3] for s in splits)


def test_the_least_recently_used_dataset_is_dropped_beyond_the_bound() -> None:
    loads = CountedLoads()
    datasets = LocalDatasets(keep=2, load=loads)
    configs = [validate_dataset_config({"name": "digits", "normalize": {"mean": [m], "std": [1.0]}}) for m in range(3)]
    first = datasets.loaded(configs[0])
    datasets.loaded(configs[1])
    assert datasets.loaded(configs[0]) is first  # used again: now the most recent
    datasets.loaded(configs[2])  # drops configs[1], the least recently used
    assert datasets.loaded(configs[0]) is first and loads.count == 3
    datasets.loaded(configs[1])
    assert loads.count == 4


def test_a_driver_reads_the_process_copy_of_a_bundled_dataset() -> None:
    with dataset_samples(DIGITS, None) as (train_set, val_set), \
            dataset_samples({**DIGITS, "batch_size": 8}, None) as (other_train, other_val):
        assert other_train.x is train_set.x and other_val.y is val_set.y  # type: ignore[attr-defined]
    assert train_set.x is BUNDLED_DATASETS.loaded(DIGITS)[0]  # type: ignore[attr-defined]


def test_a_dataset_the_stages_do_not_read_is_not_loaded_here() -> None:
    with pytest.raises(SpecError, match="the stages read only with its layout"):
        LocalDatasets().loaded(validate_dataset_config({"name": "uploaded", "dataset_id": "a" * 32}))
