"""Datasets (features float32, labels int64), their config validation, and deterministic batching."""

from arceus.data.batches import epoch_batches
from arceus.data.config import DATASETS, DatasetInfo, validate_dataset_config
from arceus.data.loader import load_dataset

__all__ = ["DATASETS", "DatasetInfo", "epoch_batches", "load_dataset", "validate_dataset_config"]
