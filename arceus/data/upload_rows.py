"""Rows of an uploaded dataset read by byte range, by whoever trains on them: where each split's `x` and `y` lie in
the file (`UploadLayout`, from its header alone), which byte ranges a set of rows takes (`row_ranges`: contiguous
rows coalesced, each range bounded), and those bytes turned into rows only once they are exactly what was asked
(`rows_decoded`; into tensors by `arceus.data.streaming.samples_of`). The control plane computes the layout (the
driver sends it in RunStep, the web process bounds an agent's reads by it); stage 0 and the last stage read their
rows with it (nodeagent/step_samples.py).

Two kinds of file are laid out so:
- "tensors", an uploaded tensor file (`upload_layout`): rows [0, train) of its `x` and `y` train, the rest
  validate (`UPLOADED_TRAIN_FRACTION`), as `arceus.data.streaming` reads them.
- "text", an uploaded text's token file (`token_layout`, arceus.data.token_file): a split's sample i is the window
  of `block_size` tokens at token i * block_size of its part, its labels the same window one token on; so `x` is
  the part's tokens seen as rows of `block_size`, and `y` that array one token later (x and y overlap by design).
Either way the samples a stage decodes are the ones the driver would have pushed, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from arceus.data.config import UPLOADED_DATASET
from arceus.data.formats import FLOAT_DTYPES, LABEL_DTYPES, StoredArray, check_dataset_id, tensor_arrays
from arceus.data.sizes import UPLOADED_TRAIN_FRACTION
from arceus.data.token_file import HEADER_BYTES, TOKEN_DTYPES, token_counts
from arceus.errors import SpecError

if TYPE_CHECKING:
    import numpy as np

# One ranged read: at most this many bytes (a longer run of rows is cut), and at most MAX_RANGES per request.
MAX_RANGE_BYTES = 8 << 20
MAX_RANGES = 256
MAX_READ_BYTES = 64 << 20  # all ranges of one request together
KINDS = ("tensors", "text")
_FIELD = "data.layout_json"


@dataclass(frozen=True)
class ArrayLayout:
    """A C-ordered little-endian array at `offset` of the file: `dtype` (numpy's name), `shape` (rows first)."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        import numpy as np

        return math.prod(self.shape[1:]) * np.dtype(self.dtype).itemsize

    @property
    def end(self) -> int:
        return self.offset + self.shape[0] * self.row_bytes

    def stored(self) -> StoredArray:
        import numpy as np

        return StoredArray(self.offset, np.dtype(self.dtype).newbyteorder("<"), self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class SplitLayout:
    """One split's samples: row i of `x` (the inputs) and of `y` (the labels) is its sample i."""

    x: ArrayLayout
    y: ArrayLayout

    @property
    def samples(self) -> int:
        return self.x.shape[0]


@dataclass(frozen=True)
class UploadLayout:
    """Where an upload's samples lie: its id, its kind ("tensors" or "text"), the file's size, and each split."""

    dataset_id: str
    kind: str
    size: int
    train: SplitLayout
    validation: SplitLayout

    def split(self, validation: bool) -> SplitLayout:
        return self.validation if validation else self.train

    def arrays(self, name: str) -> list[ArrayLayout]:
        """Both splits' `x` (the inputs) or `y` (the labels): what a reader of those may read."""
        return [getattr(self.train, name), getattr(self.validation, name)]

    def to_json(self) -> dict[str, Any]:
        def split(s: SplitLayout) -> dict[str, Any]:
            return {"x": s.x.to_json(), "y": s.y.to_json()}

        return {"dataset_id": self.dataset_id, "kind": self.kind, "size": self.size, "train": split(self.train),
                "validation": split(self.validation)}

    @classmethod
    def from_json(cls, value: Any) -> UploadLayout:
        """A layout as the driver sends it, checked whole: SpecError naming the first field that is wrong."""
        if not isinstance(value, dict) or set(value) != {"dataset_id", "kind", "size", "train", "validation"}:
            raise SpecError(_FIELD, "must be an object of dataset_id, kind, size, train and validation")
        dataset_id = check_dataset_id(value)
        if value["kind"] not in KINDS:
            raise SpecError(f"{_FIELD}.kind", f"must be one of {', '.join(KINDS)}, got {value['kind']!r}")
        size = _count(value["size"], "size")
        train, validation = (_split(value[name], name, value["kind"], size) for name in ("train", "validation"))
        for name in ("x", "y"):
            a, b = getattr(train, name), getattr(validation, name)
            if (a.dtype, a.shape[1:]) != (b.dtype, b.shape[1:]):
                raise SpecError(f"{_FIELD}.validation.{name}", f"rows are not the training split's {a.dtype} "
                                f"{list(a.shape[1:])}")
        if value["kind"] == "tensors" and any(
            x.offset < y.end and y.offset < x.end for x in (train.x, validation.x) for y in (train.y, validation.y)
        ):
            raise SpecError(_FIELD, "an x and a y overlap")
        return cls(dataset_id, value["kind"], size, train, validation)


def upload_layout(dataset_id: str, handle: BinaryIO, size: int, fmt: str) -> UploadLayout:
    """The layout of an uploaded tensor file, from its header alone (`tensor_arrays`: checked, no sample read)."""
    x, y = tensor_arrays(handle, size, fmt)
    train = int(x.shape[0] * UPLOADED_TRAIN_FRACTION)

    def rows(a: StoredArray, start: int, stop: int) -> ArrayLayout:
        return ArrayLayout(a.offset + start * a.row_bytes, a.dtype.name, (stop - start, *map(int, a.shape[1:])))

    samples = int(x.shape[0])
    return UploadLayout(dataset_id, "tensors", size, SplitLayout(rows(x, 0, train), rows(y, 0, train)),
                        SplitLayout(rows(x, train, samples), rows(y, train, samples)))


def token_layout(dataset_id: str, handle: BinaryIO, size: int, block: int) -> UploadLayout:
    """The windows of `block` tokens of an uploaded text's token file (arceus.data.token_file), from its header
    alone; SpecError naming a part too short for one window, TokenFileError for a file that is not a token file."""
    counts = token_counts(handle, size)
    itemsize, dtype = counts.itemsize, TOKEN_DTYPES[counts.itemsize]
    splits, first = [], 0
    for part, tokens in (("training", counts.train), ("validation", counts.validation)):
        if tokens <= block:
            raise SpecError("dataset_config.dataset_id", f"the {part} part of dataset {dataset_id} has {tokens} "
                            f"tokens; a window of block_size {block} needs more than {block}")
        windows, offset = (tokens - 1) // block, HEADER_BYTES + first * itemsize
        splits.append(SplitLayout(ArrayLayout(offset, dtype, (windows, block)),
                                  ArrayLayout(offset + itemsize, dtype, (windows, block))))
        first += tokens
    return UploadLayout(dataset_id, "text", size, *splits)


def layout_of(cfg: dict[str, Any], handle: BinaryIO, size: int) -> UploadLayout:
    """The layout of the file a validated upload config's samples are read from (`size` bytes open as `handle`): an
    uploaded tensor file's, or an uploaded text's token file's windows of its `block_size`."""
    if cfg["name"] == UPLOADED_DATASET:
        return upload_layout(cfg["dataset_id"], handle, size, cfg["format"])
    if "block_size" not in cfg:
        raise SpecError("dataset_config.block_size", "is required to cut the text into windows")
    return token_layout(cfg["dataset_id"], handle, size, cfg["block_size"])


def row_ranges(array: ArrayLayout, rows: list[int]) -> list[tuple[int, int]]:
    """The byte ranges [start, stop) of `array` holding `rows` (any order, repeats allowed): each run of contiguous
    rows one range, cut at MAX_RANGE_BYTES; ascending. ValueError for a row outside the array."""
    if not rows:
        return []
    if min(rows) < 0 or max(rows) >= array.shape[0]:
        raise ValueError(f"rows {min(rows)}..{max(rows)} are not all among the array's {array.shape[0]}")
    per_range = max(1, MAX_RANGE_BYTES // array.row_bytes)
    ranges: list[tuple[int, int]] = []
    first = previous = None
    for row in sorted(set(rows)):
        if first is None or row != previous + 1 or row - first >= per_range:
            if first is not None:
                ranges.append((first, previous + 1))
            first = row
        previous = row
    ranges.append((first, previous + 1))
    return [(array.offset + a * array.row_bytes, array.offset + b * array.row_bytes) for a, b in ranges]


def ranges_checked(ranges: list[tuple[int, int]], allowed: list[tuple[int, int]]) -> None:
    """Raise ValueError unless `ranges` are at most MAX_RANGES non-empty ranges of at most MAX_RANGE_BYTES each, at
    most MAX_READ_BYTES together, each inside one of `allowed` (the arrays a reader may read)."""
    if not ranges:
        raise ValueError("names no range")
    if len(ranges) > MAX_RANGES:
        raise ValueError(f"names {len(ranges)} ranges; at most {MAX_RANGES} a request")
    for start, stop in ranges:
        if not 0 < stop - start <= MAX_RANGE_BYTES:
            raise ValueError(f"range [{start}, {stop}) is not 1 to {MAX_RANGE_BYTES} bytes")
        if not any(low <= start and stop <= high for low, high in allowed):
            raise ValueError(f"range [{start}, {stop}) lies outside the rows this reader may read")
    total = sum(stop - start for start, stop in ranges)
    if total > MAX_READ_BYTES:
        raise ValueError(f"names {total} bytes; at most {MAX_READ_BYTES} a request")


def rows_decoded(array: ArrayLayout, rows: list[int], ranges: list[tuple[int, int]], data: list[bytes]) -> np.ndarray:
    """`rows` of `array`, in their order, from the bytes of `ranges` (`row_ranges` of those rows) as a reader
    answered them; ValueError unless every range came back whole."""
    import numpy as np

    if len(data) != len(ranges):
        raise ValueError(f"{len(data)} answers for {len(ranges)} ranges")
    dtype, row_bytes = np.dtype(array.dtype).newbyteorder("<"), array.row_bytes
    where: dict[int, tuple[int, int]] = {}  # row -> (answer, offset in it)
    for i, ((start, stop), chunk) in enumerate(zip(ranges, data, strict=True)):
        if len(chunk) != stop - start:
            raise ValueError(f"range [{start}, {stop}) came back as {len(chunk)} bytes")
        first = (start - array.offset) // row_bytes
        for k in range((stop - start) // row_bytes):
            where[first + k] = (i, k * row_bytes)
    out = np.empty((len(rows), *array.shape[1:]), dtype=dtype)
    for j, row in enumerate(rows):
        i, offset = where[row]
        out[j] = np.frombuffer(data[i], dtype=dtype, count=math.prod(array.shape[1:]), offset=offset).reshape(
            array.shape[1:]
        )
    return out


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
        raise SpecError(f"{_FIELD}.{name}", f"must be a count (an integer >= 0), got {value!r}")
    return value


def _split(value: Any, name: str, kind: str, size: int) -> SplitLayout:
    field = f"{_FIELD}.{name}"
    if not isinstance(value, dict) or set(value) != {"x", "y"}:
        raise SpecError(field, "must be an object of x and y")
    if kind == "tensors":
        x = _array(value["x"], f"{name}.x", FLOAT_DTYPES, (2, 4))
        y = _array(value["y"], f"{name}.y", LABEL_DTYPES, (1,))
        if y.shape[0] != x.shape[0]:
            raise SpecError(f"{field}.y.shape", f"holds {y.shape[0]} labels for {x.shape[0]} samples")
    else:
        x, y = (_array(value[a], f"{name}.{a}", tuple(TOKEN_DTYPES.values()), (2,)) for a in ("x", "y"))
        if (y.dtype, y.shape, y.offset) != (x.dtype, x.shape, x.offset + x.row_bytes // x.shape[1]):
            raise SpecError(f"{field}.y", "must be x's windows one token on (the next tokens are the labels)")
    for a, array in (("x", x), ("y", y)):
        if array.end > size:
            raise SpecError(f"{field}.{a}", f"runs past the file's {size} bytes to {array.end}")
    return SplitLayout(x, y)


def _array(value: Any, name: str, dtypes: tuple[str, ...], ranks: tuple[int, ...]) -> ArrayLayout:
    field = f"{_FIELD}.{name}"
    if not isinstance(value, dict) or set(value) != {"offset", "dtype", "shape"}:
        raise SpecError(field, "must be an object of offset, dtype and shape")
    if value["dtype"] not in dtypes:
        raise SpecError(f"{field}.dtype", f"must be one of {', '.join(dtypes)}, got {value['dtype']!r}")
    shape = value["shape"]
    if not isinstance(shape, list) or len(shape) not in ranks:
        raise SpecError(f"{field}.shape", f"must be a list of {' or '.join(map(str, ranks))} sizes")
    sizes = tuple(_count(s, f"{name}.shape") for s in shape)
    if 0 in sizes or math.prod(sizes[1:]) > 1 << 31:
        raise SpecError(f"{field}.shape", f"{list(sizes)} is empty or a row larger than 2**31 values")
    return ArrayLayout(_count(value["offset"], f"{name}.offset"), value["dtype"], sizes)
