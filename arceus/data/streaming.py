"""The samples a driver trains on, read a batch at a time: in memory for the bundled datasets, from a file for an
uploaded one, so the driver's memory stays flat however large the upload.

An upload is read row by row by its `UploadLayout` (arceus.data.upload_rows): an uploaded tensor file's rows (the
first 90% train, the rest validate), or the windows of an uploaded text's token file, which the control plane
tokenized once (arceus.data.token_file). Its stages read the rows of their steps themselves, so a driver reads
only the file's header and the micro-batch a spot check recomputes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch

from arceus.data.config import DatasetOpener
from arceus.data.formats import DatasetFormatError
from arceus.data.loader import load_dataset
from arceus.data.step_data import BUNDLED_DATASETS, stages_read
from arceus.data.upload_rows import UploadLayout, layout_of
from arceus.errors import SpecError


class Samples(Protocol):
    def __len__(self) -> int: ...

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the samples at `indices`, in their order."""
        ...


class InMemorySamples:
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]


class UploadRows:
    """A split of an upload (`layout`'s training or validation rows), read row by row."""

    def __init__(self, handle: BinaryIO, layout: UploadLayout, *, validation: bool) -> None:
        self._handle, self.layout, self.validation = handle, layout, validation
        split = layout.split(validation)
        self._n, self._x, self._y = split.samples, split.x.stored(), split.y.stored()

    def __len__(self) -> int:
        return self._n

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [int(i) for i in indices]
        x = np.stack([self._x.rows(self._handle, r, r + 1)[0] for r in rows])
        y = np.stack([self._y.rows(self._handle, r, r + 1)[0] for r in rows])
        return samples_of(x, y, self.layout.kind)


def samples_of(x: np.ndarray, y: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of an upload of `kind` as training tensors (`inputs_of`, `labels_of`)."""
    return inputs_of(x, kind), labels_of(y)


def inputs_of(x: np.ndarray, kind: str) -> torch.Tensor:
    """x rows as the first stage takes them, the driver's reads and a stage's (nodeagent/step_samples.py) alike: a
    text's token ids as int64; tensors as float32 (uint8 pixels scaled to [0, 1]) flattened per sample."""
    if kind == "text":
        return torch.from_numpy(x.astype(np.int64))
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
    return torch.from_numpy(x.reshape(len(x), -1))


def labels_of(y: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(y.astype(np.int64))


@contextlib.contextmanager
def dataset_samples(cfg: dict[str, Any], open_file: DatasetOpener | None) -> Iterator[tuple[Samples, Samples]]:
    """(train, validation) samples of a validated dataset config: an upload's read from its file while inside,
    a bundled dataset's in memory (shared by the process's threads, `BUNDLED_DATASETS`)."""
    if "dataset_id" in cfg:
        with uploaded_samples(cfg, open_file) as splits:
            yield splits
        return
    # A dataset the stages read is the process's one copy (a training worker's drivers are its threads); the driver
    # reads only what it spot-checks or validates of it.
    train_x, train_y, val_x, val_y = BUNDLED_DATASETS.loaded(cfg) if stages_read(cfg) else load_dataset(cfg)
    yield InMemorySamples(train_x, train_y), InMemorySamples(val_x, val_y)


@contextlib.contextmanager
def uploaded_samples(cfg: dict[str, Any], open_file: DatasetOpener | None) -> Iterator[tuple[Samples, Samples]]:
    """(train, validation) of a validated config naming an upload (`dataset_id`), open while inside: only the file's
    header is read here (`layout_of`), the rows as they are taken."""
    if open_file is None:
        raise SpecError(
            "dataset_config.dataset_id", "an uploaded dataset is read only by a driver the control plane runs"
        )
    with open_file(cfg) as handle:
        try:
            layout = layout_of(cfg, handle, _size(handle))
            yield UploadRows(handle, layout, validation=False), UploadRows(handle, layout, validation=True)
        except DatasetFormatError as exc:
            raise SpecError("dataset_config.dataset_id", f"dataset {cfg['dataset_id']}: {exc}") from exc


def _size(handle: BinaryIO) -> int:
    position = handle.tell()
    size = handle.seek(0, 2)
    handle.seek(position)
    return size
