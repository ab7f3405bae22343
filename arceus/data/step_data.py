"""A step's samples named by their positions, which stage 0 and the last stage read themselves: the driver sends a
batch's indices (`epoch_batches`' order) in RunStep, never the samples.

A dataset every agent holds is read this way from memory (`stages_read`, `LocalDatasets`): the bundled digits and
the bundled text. An upload is too, by byte range through the control plane, with the layout the driver read from
the file's header (arceus.data.upload_rows): a tensor file's rows, or the windows of an uploaded text's token file
(tokenized once by the control plane, arceus.data.token_file). A dataset at a path on the control plane (MNIST, a
`source` text) is pushed by the driver as before.
Micro-batch m of a batch is `torch.tensor_split(indices, micro_batches)[m]`, as the driver splits the samples it
pushes, so either way a stage computes on the same rows in the same order and training equals one process.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.data.text_config import TEXT_DATASET
from arceus.errors import SpecError

_CACHED = 2  # datasets kept loaded per process (a job's, and the next job's while the first ends)


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
    """Bundled datasets loaded once per process, by their config's canonical JSON (the last `_CACHED` of them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def split(self, dataset_json: str, validation: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the training or validation split a RunStep's dataset config names; SpecError (its field named)
        for a config that does not parse, does not validate, or names a dataset the stages do not read."""
        try:
            raw = json.loads(dataset_json)
        except json.JSONDecodeError as exc:
            raise SpecError("data.dataset_json", f"is not JSON: {exc}") from exc
        cfg = validate_dataset_config(raw)
        if not stages_read(cfg):
            raise SpecError("data.dataset_json", f"names {cfg['name']!r} data that the stages read only with its "
                            "layout (an uploaded tensor dataset's) or not at all")
        key = json.dumps(cfg, sort_keys=True)
        with self._lock:  # one load per dataset, however many stages of this agent ask at once
            if key not in self._loaded:
                while len(self._loaded) >= _CACHED:
                    del self._loaded[next(iter(self._loaded))]
                self._loaded[key] = load_dataset(cfg)
            train_x, train_y, val_x, val_y = self._loaded[key]
        return (val_x, val_y) if validation else (train_x, train_y)


def checked_indices(indices: list[int], size: int) -> torch.Tensor:
    """`indices` as a tensor once each is a sample of a split of `size`; SpecError naming the first that is not."""
    tensor = torch.tensor(indices, dtype=torch.int64)
    if len(tensor) and (int(tensor.min()) < 0 or int(tensor.max()) >= size):
        bad = next(i for i in indices if not 0 <= i < size)
        raise SpecError("data.indices", f"index {bad} is outside the split's {size} samples")
    return tensor
