"""Rows of an uploaded tensor dataset read by byte range, by whoever trains on them: where `x` and `y` lie in the
file (`UploadLayout`, from its header alone), which byte ranges a set of rows takes (`row_ranges`: contiguous rows
coalesced, each range bounded), and those bytes turned into rows only once they are exactly what was asked
(`rows_decoded`; into tensors by `arceus.data.streaming.samples_of`). The control plane computes the layout (the
driver sends it in RunStep, the web process bounds an agent's reads by it); stage 0 and the last stage read their
rows with it (nodeagent/step_samples.py).

Rows [0, train) train and [train, samples) validate (`UPLOADED_TRAIN_FRACTION`), as `arceus.data.streaming` reads
them: the samples a stage decodes are the ones the driver would have pushed, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from arceus.data.formats import FLOAT_DTYPES, LABEL_DTYPES, StoredArray, check_dataset_id, tensor_arrays
from arceus.data.sizes import UPLOADED_TRAIN_FRACTION
from arceus.errors import SpecError

if TYPE_CHECKING:
    import numpy as np

# One ranged read: at most this many bytes (a longer run of rows is cut), and at most MAX_RANGES per request.
MAX_RANGE_BYTES = 8 << 20
MAX_RANGES = 256
MAX_READ_BYTES = 64 << 20  # all ranges of one request together
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


@dataclass(frozen=True)
class UploadLayout:
    """Where an uploaded tensor dataset's samples lie: its id, file size, `x` and `y`, and the training rows."""

    dataset_id: str
    size: int
    x: ArrayLayout
    y: ArrayLayout
    train: int  # rows [0, train) train, [train, samples) validate

    @property
    def samples(self) -> int:
        return self.x.shape[0]

    def split(self, validation: bool) -> tuple[int, int]:
        """[start, stop) rows of the training or the validation split."""
        return (self.train, self.samples) if validation else (0, self.train)

    def to_json(self) -> dict[str, Any]:
        def array(a: ArrayLayout) -> dict[str, Any]:
            return {"offset": a.offset, "dtype": a.dtype, "shape": list(a.shape)}

        return {"dataset_id": self.dataset_id, "size": self.size, "x": array(self.x), "y": array(self.y),
                "train": self.train}

    @classmethod
    def from_json(cls, value: Any) -> UploadLayout:
        """A layout as the driver sends it, checked whole: SpecError naming the first field that is wrong."""
        if not isinstance(value, dict) or set(value) != {"dataset_id", "size", "x", "y", "train"}:
            raise SpecError(_FIELD, "must be an object of dataset_id, size, x, y and train")
        dataset_id = check_dataset_id(value)
        size = _count(value["size"], "size")
        x = _array(value["x"], "x", FLOAT_DTYPES, (2, 4))
        y = _array(value["y"], "y", LABEL_DTYPES, (1,))
        train = _count(value["train"], "train")
        if y.shape[0] != x.shape[0]:
            raise SpecError(f"{_FIELD}.y.shape", f"holds {y.shape[0]} labels for {x.shape[0]} samples")
        if not 0 < train < x.shape[0]:
            raise SpecError(f"{_FIELD}.train", f"must leave both splits a sample of {x.shape[0]}, got {train}")
        for name, a in (("x", x), ("y", y)):
            if a.end > size:
                raise SpecError(f"{_FIELD}.{name}", f"runs past the file's {size} bytes to {a.end}")
        if x.offset < y.end and y.offset < x.end:
            raise SpecError(_FIELD, "x and y overlap")
        return cls(dataset_id, size, x, y, train)


def upload_layout(dataset_id: str, handle: BinaryIO, size: int, fmt: str) -> UploadLayout:
    """The layout of an uploaded tensor file, from its header alone (`tensor_arrays`: checked, no sample read)."""
    x, y = tensor_arrays(handle, size, fmt)

    def array(a: StoredArray) -> ArrayLayout:
        return ArrayLayout(a.offset, a.dtype.name, tuple(int(s) for s in a.shape))

    return UploadLayout(dataset_id, size, array(x), array(y), int(x.shape[0] * UPLOADED_TRAIN_FRACTION))


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
