"""The samples a driver trains on, read a batch at a time: in memory for the bundled datasets, from the file for
an uploaded one, so the driver's memory stays flat however large the upload.

An uploaded tensor dataset is read row by row from its file (`StoredArray`, by its `UploadLayout`): the first
90% of the samples train, the rest validate. Its stages read the rows of their steps themselves
(arceus.data.upload_rows), so a driver reads only the header and the micro-batch a spot check recomputes.

An uploaded text dataset is tokenized once, a chunk at a time, into a temporary file of int32 token ids (90/10 by
characters, as the bundled text), whose windows of `block_size` tokens are then read as the batches name them and
pushed by the driver (no stage can reach that file); its BPE tokenizer, where the job asks for one, is trained on
the training part streamed the same way.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch

from arceus.data.config import DatasetOpener
from arceus.data.formats import DatasetFormatError, text_chunks
from arceus.data.loader import load_dataset
from arceus.data.tokenizer import TRAIN_FRACTION, BPETokenizer, CharTokenizer, TextTokenizer, train_bpe_from
from arceus.data.upload_rows import UploadLayout, upload_layout
from arceus.errors import SpecError

_TOKEN_DTYPE = np.dtype("<i4")
_PIECE_CHARS = 1 << 20


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


class TensorRows:
    """A split of an uploaded tensor file (`layout`'s training or validation rows), read row by row."""

    def __init__(self, handle: BinaryIO, layout: UploadLayout, *, validation: bool) -> None:
        self._handle, self.layout, self.validation = handle, layout, validation
        self._start, stop = layout.split(validation)
        self._n = stop - self._start
        self._x, self._y = layout.x.stored(), layout.y.stored()

    def __len__(self) -> int:
        return self._n

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self._start + int(i) for i in indices]
        x = np.stack([self._x.rows(self._handle, r, r + 1)[0] for r in rows])
        y = np.stack([self._y.rows(self._handle, r, r + 1)[0] for r in rows])
        return samples_of(x, y)


def samples_of(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of an uploaded tensor file as training tensors (`inputs_of`, `labels_of`)."""
    return inputs_of(x), labels_of(y)


def inputs_of(x: np.ndarray) -> torch.Tensor:
    """x rows as float32 (uint8 pixels scaled to [0, 1]) flattened per sample: the driver's reads and a stage's
    (nodeagent/step_samples.py) alike."""
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
    return torch.from_numpy(x.reshape(len(x), -1))


def labels_of(y: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(y.astype(np.int64))


class TokenWindows:
    """Non-overlapping windows of `block` tokens of a token file's [start, stop), the next tokens as targets."""

    def __init__(self, handle: BinaryIO, start: int, stop: int, block: int) -> None:
        self._handle, self._start, self._block = handle, start, block
        self._n = max(0, (stop - start - 1) // block)

    def __len__(self) -> int:
        return self._n

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = _TOKEN_DTYPE.itemsize
        windows = []
        for i in indices:
            self._handle.seek((self._start + int(i) * self._block) * size)
            windows.append(np.frombuffer(self._handle.read((self._block + 1) * size), dtype=_TOKEN_DTYPE))
        ids = torch.from_numpy(np.stack(windows).astype(np.int64))
        return ids[:, :-1], ids[:, 1:]


@contextlib.contextmanager
def dataset_samples(cfg: dict[str, Any], open_file: DatasetOpener | None) -> Iterator[tuple[Samples, Samples]]:
    """(train, validation) samples of a validated dataset config: an upload's read from its file while inside,
    a bundled dataset's in memory."""
    if "dataset_id" in cfg:
        with uploaded_samples(cfg, open_file) as splits:
            yield splits
        return
    train_x, train_y, val_x, val_y = load_dataset(cfg)
    yield InMemorySamples(train_x, train_y), InMemorySamples(val_x, val_y)


@contextlib.contextmanager
def uploaded_samples(cfg: dict[str, Any], open_file: DatasetOpener | None) -> Iterator[tuple[Samples, Samples]]:
    """(train, validation) of a validated config naming an uploaded dataset (`dataset_id`), open while inside."""
    if open_file is None:
        raise SpecError(
            "dataset_config.dataset_id", "an uploaded dataset is read only by a driver the control plane runs"
        )
    with contextlib.ExitStack() as stack:
        handle = stack.enter_context(open_file(cfg["dataset_id"]))
        try:
            if cfg["kind"] == "tensors":
                layout = upload_layout(cfg["dataset_id"], handle, _size(handle), cfg["format"])
                yield TensorRows(handle, layout, validation=False), TensorRows(handle, layout, validation=True)
                return
            tokenizer = uploaded_tokenizer(cfg, handle, open_file)
            tokens = stack.enter_context(tempfile.TemporaryFile(prefix="arceus-tokens-"))
            split = _tokenize(cfg, handle, tokenizer, tokens)
            block = cfg["block_size"]
            for part, (start, stop) in zip(("training", "validation"), split, strict=True):
                if stop - start <= block:
                    raise SpecError(
                        "dataset_config.dataset_id",
                        f"the {part} part of dataset {cfg['dataset_id']} has {stop - start} tokens; "
                        f"a window of block_size {block} needs more than {block}",
                    )
            (train_start, train_stop), (val_start, val_stop) = split
            yield TokenWindows(tokens, train_start, train_stop, block), TokenWindows(tokens, val_start, val_stop, block)
        except DatasetFormatError as exc:
            raise SpecError("dataset_config.dataset_id", f"dataset {cfg['dataset_id']}: {exc}") from exc


def uploaded_tokenizer(cfg: dict[str, Any], handle: BinaryIO, open_file: DatasetOpener) -> TextTokenizer:
    """The tokenizer of an uploaded text dataset: its characters, a BPE trained on its training part, or the
    uploaded tokenizer.json its `tokenizer_id` names."""
    if cfg.get("tokenizer_id"):
        from tokenizers import Tokenizer

        with open_file(cfg["tokenizer_id"]) as tokenizer_file:
            return BPETokenizer(Tokenizer.from_str(tokenizer_file.read().decode("utf-8")), cfg["vocab_size"])
    if cfg.get("vocab", "char") == "char":
        return CharTokenizer(cfg["vocabulary"])
    return train_bpe_from((text for _, text in _pieces(cfg, handle, train_only=True)), cfg["vocab_size"])


def _tokenize(
    cfg: dict[str, Any], handle: BinaryIO, tokenizer: TextTokenizer, out: BinaryIO
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Write the training part's tokens, then the validation part's, to `out`; each part's [start, stop)."""
    bounds = {"training": 0, "validation": 0}
    for part, text in _pieces(cfg, handle, train_only=False):
        ids = tokenizer.encode(text)
        out.write(np.asarray(ids, dtype=_TOKEN_DTYPE).tobytes())
        bounds[part] += len(ids)
    train = bounds["training"]
    return (0, train), (train, train + bounds["validation"])


def _pieces(cfg: dict[str, Any], handle: BinaryIO, *, train_only: bool) -> Iterator[tuple[str, str]]:
    """("training" | "validation", text) pieces in order, cut at the 90% character mark as the bundled text is,
    and otherwise at line ends (a BPE word is never cut) or every `_PIECE_CHARS` characters in a line-less text."""
    cut = int(cfg["characters"] * TRAIN_FRACTION)
    part, seen, pending = "training", 0, ""
    for chunk in text_chunks(handle, cfg["format"], cfg.get("column", "text")):
        if part == "training" and seen + len(chunk) >= cut:
            yield part, pending + chunk[: cut - seen]
            if train_only:
                return
            part, pending, chunk = "validation", "", chunk[cut - seen :]
        seen += len(chunk)
        pending += chunk
        end = pending.rfind("\n") + 1 or (len(pending) if len(pending) >= _PIECE_CHARS else 0)
        if end:
            yield part, pending[:end]
            pending = pending[end:]
    if pending:
        yield part, pending


def _size(handle: BinaryIO) -> int:
    position = handle.tell()
    size = handle.seek(0, 2)
    handle.seek(position)
    return size
