"""A step's samples named by their positions, which stage 0 and the last stage read themselves: the driver sends a
batch's indices (`epoch_batches`' order) in RunStep, never the samples.

A dataset every agent holds is read this way from memory (`stages_read`): the bundled digits and the bundled text,
one copy a process (`BUNDLED_DATASETS`), which a training worker's drivers share too. An upload is too, by byte
range through the control plane, with the layout the driver read from the file's header (arceus.data.upload_rows):
a tensor file's rows, or the windows of an uploaded text's token file (tokenized once by the control plane,
arceus.data.token_file). A dataset at a path on the control plane (MNIST, a
`source` text) is pushed by the driver as before.
Micro-batch m of a batch is `torch.tensor_split(indices, micro_batches)[m]`, as the driver splits the samples it
pushes, so either way a stage computes on the same rows in the same order and training equals one process.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.data.sources import Split
from arceus.data.text_config import TEXT_DATASET
from arceus.errors import SpecError

# Bundled datasets kept loaded per process after their last use: a training worker's drivers train on a few configs
# at once (one evicted while a driver trains on it lives on in that driver until it ends), an agent's stages on fewer.
_CACHED = 4
# Config fields that shape a batch, not the samples loaded: jobs differing only in them share one copy.
_BATCH_FIELDS = ("batch_size", "val_batch_size")


def stages_read(cfg: dict[str, Any]) -> bool:
    """Whether the stages read this validated config's samples themselves: a bundled dataset, with no path."""
    if "dataset_id" in cfg or "path" in cfg or "source" in cfg:
        return False
    return cfg["name"] in ("digits", TEXT_DATASET)


def labels_per_sample(cfg: dict[str, Any]) -> int:
    """Loss terms per sample of a validated config: a text window's positions, else one label."""
    return cfg["block_size"] if cfg["name"] == TEXT_DATASET else 1


def micro_batch_indices(indices: torch.Tensor, micro_batches: int) -> tuple[torch.Tensor, ...]:
    """Each micro-batch's sample indices: the driver's split of a batch, which a stage reading it repeats."""
    return torch.tensor_split(indices, micro_batches)


class LocalDatasets:
    """Bundled datasets loaded once per process and shared read-only by every thread that asks (an agent's stages, a
    training worker's drivers): keyed by what shapes the samples (the validated config less its batch sizes), the
    `keep` most recently used kept. Nobody writes to them: readers index them (`x[indices]` copies)."""

    def __init__(self, keep: int = _CACHED, load: Callable[[dict[str, Any]], Split] = load_dataset) -> None:
        self._keep, self._load = keep, load
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, Split] = OrderedDict()  # least recently used first

    def loaded(self, cfg: dict[str, Any]) -> Split:
        """(train_x, train_y, val_x, val_y) of a validated config the stages read (`stages_read`); SpecError for one
        they do not."""
        if not stages_read(cfg):
            raise SpecError("data.dataset_json", f"names {cfg['name']!r} data that the stages read only with its "
                            "layout (an uploaded tensor dataset's) or not at all")
        key = json.dumps({k: v for k, v in cfg.items() if k not in _BATCH_FIELDS}, sort_keys=True)
        with self._lock:  # one load per dataset, however many threads ask at once
            if key in self._loaded:
                self._loaded.move_to_end(key)
            else:
                while len(self._loaded) >= self._keep:
                    self._loaded.popitem(last=False)
                self._loaded[key] = self._load(cfg)
            return self._loaded[key]

    def split(self, dataset_json: str, validation: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the training or validation split a RunStep's dataset config names; SpecError (its field named)
        for a config that does not parse, does not validate, or names a dataset the stages do not read."""
        try:
            raw = json.loads(dataset_json)
        except json.JSONDecodeError as exc:
            raise SpecError("data.dataset_json", f"is not JSON: {exc}") from exc
        train_x, train_y, val_x, val_y = self.loaded(validate_dataset_config(raw))
        return (val_x, val_y) if validation else (train_x, train_y)


# This process's one copy of each bundled dataset: its agent's stages and its drivers read the same.
BUNDLED_DATASETS = LocalDatasets()


def checked_indices(indices: list[int], size: int) -> torch.Tensor:
    """`indices` as a tensor once each is a sample of a split of `size`; SpecError naming the first that is not."""
    tensor = torch.tensor(indices, dtype=torch.int64)
    if len(tensor) and (int(tensor.min()) < 0 or int(tensor.max()) >= size):
        bad = next(i for i in indices if not 0 <= i < size)
        raise SpecError("data.indices", f"index {bad} is outside the split's {size} samples")
    return tensor
