"""Uploaded dataset files: which formats exist, what a file of each must hold, and reading one a piece at a time.

- "text": UTF-8 text. "jsonl": one JSON object per line with a string field `column` ("text" by default).
  "parquet": a string column `column` (read with pyarrow). The three are text: records are joined by "\n".
- "safetensors": tensors `x` (float, [N, F] or [N, C, H, W]) and `y` (integer class labels >= 0, [N]).
  "npz": `x.npy` and `y.npy` in an uncompressed zip (`numpy.savez`, never pickled: object arrays refused).
- "tokenizer": a Hugging Face `tokenizer.json` a text dataset may name as its tokenizer.

`inspect_file` checks a whole file in one streaming pass (memory bounded by a chunk, never the file) and
returns its facts (JSON-able): text's characters and distinct characters, tensors' samples, features, classes.
Nothing here unpickles: `.npy` headers are parsed by numpy's header reader and object dtypes refused.
"""

from __future__ import annotations

import codecs
import io
import json
import math
import struct
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from arceus.errors import SpecError
from arceus.json_input import json_depth_check, json_loads_bounded

if TYPE_CHECKING:
    import numpy as np

TEXT_FORMATS = ("text", "jsonl", "parquet")
TENSOR_FORMATS = ("safetensors", "npz")
FORMATS = (*TEXT_FORMATS, *TENSOR_FORMATS, "tokenizer")
DEFAULT_TEXT_COLUMN = "text"
RECORD_SEPARATOR = "\n"  # between jsonl/parquet records, so a text model sees where one ends
CHUNK_BYTES = 1 << 20
MAX_VOCABULARY = 65536  # distinct characters kept as facts (a char vocabulary); more: bpe only
MAX_HEADER_BYTES = 1 << 20  # a safetensors or .npy header
MAX_JSONL_LINE_BYTES = 16 << 20
MAX_TOKENIZER_BYTES = 64 << 20
# numpy's names: numpy is imported where an array is read, not with this module, which every control-plane process
# imports (the datasets' models) and few use to read one.
_FLOAT_DTYPES = {"F32": "float32", "F64": "float64", "F16": "float16", "U8": "uint8"}
_LABEL_DTYPES = {"I64": "int64", "I32": "int32", "I16": "int16", "U8": "uint8"}
FLOAT_DTYPES = tuple(_FLOAT_DTYPES.values())  # numpy's names of the dtypes x may have
LABEL_DTYPES = tuple(_LABEL_DTYPES.values())  # and y


class DatasetFormatError(ValueError):
    """The file is not what its format says; the message names what is wrong and how to fix it."""


@dataclass(frozen=True)
class StoredArray:
    """A C-ordered little-endian array at `offset` of a file: read by rows, never whole."""

    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def rows(self, handle: BinaryIO, start: int, stop: int) -> np.ndarray:
        import numpy as np

        handle.seek(self.offset + start * self.row_bytes)
        data = handle.read((stop - start) * self.row_bytes)
        if len(data) != (stop - start) * self.row_bytes:
            raise DatasetFormatError(f"the file ends inside rows {start}..{stop}: truncated")
        return np.frombuffer(data, dtype=self.dtype).reshape((stop - start, *self.shape[1:]))


def check_dataset_id(cfg: dict[str, Any], key: str = "dataset_id") -> str:
    value = cfg.get(key)
    try:
        if isinstance(value, str):
            return str(uuid.UUID(value))
    except ValueError:
        pass
    raise SpecError(f"dataset_config.{key}", f"must be an uploaded dataset's id (a UUID), got {value!r}")


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise DatasetFormatError(f"unknown format {fmt!r}; one of: {', '.join(FORMATS)}")


def inspect_file(handle: BinaryIO, size: int, fmt: str, column: str = DEFAULT_TEXT_COLUMN) -> dict[str, Any]:
    """The facts of a whole file of `fmt`; DatasetFormatError if it is not one."""
    check_format(fmt)
    if fmt in TEXT_FORMATS:
        chars, seen = 0, set()
        for chunk in text_chunks(handle, fmt, column):
            chars += len(chunk)
            if len(seen) <= MAX_VOCABULARY:
                seen.update(chunk)
        if chars == 0:
            raise DatasetFormatError("the file holds no text")
        vocabulary = "".join(sorted(seen)) if len(seen) <= MAX_VOCABULARY else None
        return {"kind": "text", "characters": chars, "vocabulary": vocabulary}
    if fmt == "tokenizer":
        return _inspect_tokenizer(handle, size)
    x, y = tensor_arrays(handle, size, fmt)
    classes = 0
    for start in range(0, y.shape[0], CHUNK_BYTES // y.row_bytes):
        labels = y.rows(handle, start, min(y.shape[0], start + CHUNK_BYTES // y.row_bytes))
        if labels.size and int(labels.min()) < 0:
            raise DatasetFormatError("y holds a negative label; labels are class indices 0, 1, 2, ...")
        classes = max(classes, int(labels.max()) + 1 if labels.size else 0)
    if classes < 2:
        raise DatasetFormatError(f"y holds {classes} class(es); a classifier needs at least 2")
    return {
        "kind": "tensors",
        "samples": x.shape[0],
        "features": math.prod(x.shape[1:]),
        "image_shape": list(x.shape[1:]) if len(x.shape) == 4 else None,
        "classes": classes,
    }


# --- text ---------------------------------------------------------------------------------------------
def text_chunks(handle: BinaryIO, fmt: str, column: str = DEFAULT_TEXT_COLUMN) -> Iterator[str]:
    """The text of a text-format file as strings of about a chunk each, from the start."""
    handle.seek(0)
    if fmt == "text":
        yield from _utf8_chunks(handle)
    elif fmt == "jsonl":
        yield from _jsonl_texts(handle, column)
    elif fmt == "parquet":
        yield from _parquet_texts(handle, column)
    else:
        raise DatasetFormatError(f"format {fmt!r} is not text")


def _utf8_chunks(handle: BinaryIO) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    while True:
        data = handle.read(CHUNK_BYTES)
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            raise DatasetFormatError(
                f"not UTF-8 at byte {offset + exc.start}: {exc.reason}; save the text as UTF-8"
            ) from None
        offset += len(data)
        if text:
            yield text
        if not data:
            return


def _jsonl_texts(handle: BinaryIO, column: str) -> Iterator[str]:
    first = True
    for number, line in enumerate(_lines(handle), start=1):
        if not line.strip():
            continue
        try:
            json_depth_check(line.decode(), where=f"line {number}")
            record = json.loads(line)
        except SpecError as exc:
            raise DatasetFormatError(f"line {number} {exc.message}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DatasetFormatError(f"line {number} is not UTF-8 JSON: {exc}") from None
        if not isinstance(record, dict) or not isinstance(record.get(column), str):
            raise DatasetFormatError(
                f"line {number} has no string field {column!r}; every line must be an object with one "
                "(or name the field as the dataset's column)"
            )
        yield record[column] if first else RECORD_SEPARATOR + record[column]
        first = False


def _lines(handle: BinaryIO) -> Iterator[bytes]:
    pending = b""
    while data := handle.read(CHUNK_BYTES):
        pending += data
        *lines, pending = pending.split(b"\n")
        yield from lines
        if len(pending) > MAX_JSONL_LINE_BYTES:
            raise DatasetFormatError(f"a line is longer than {MAX_JSONL_LINE_BYTES} bytes")
    if pending:
        yield pending


def _parquet_texts(handle: BinaryIO, column: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(handle)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetFormatError(f"not a Parquet file: {exc}") from None
    field = parquet.schema_arrow.field(column) if column in parquet.schema_arrow.names else None
    if field is None:
        raise DatasetFormatError(
            f"no column {column!r}; the file has {', '.join(parquet.schema_arrow.names)} (name the text column)"
        )
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise DatasetFormatError(f"column {column!r} is {field.type}, not a string column")
    first = True
    try:
        for batch in parquet.iter_batches(batch_size=1024, columns=[column]):
            texts = [t for t in batch.column(0).to_pylist() if t is not None]
            if texts:
                yield ("" if first else RECORD_SEPARATOR) + RECORD_SEPARATOR.join(texts)
                first = False
    except (pa.ArrowException, OSError) as exc:
        raise DatasetFormatError(f"cannot read column {column!r}: {exc}") from None


# --- tensors ------------------------------------------------------------------------------------------
def tensor_arrays(handle: BinaryIO, size: int, fmt: str) -> tuple[StoredArray, StoredArray]:
    """Where `x` and `y` lie in a tensor file, checked: dtypes, shapes, one label per sample, inside the file."""
    arrays = _safetensors_arrays(handle, size) if fmt == "safetensors" else _npz_arrays(handle, size)
    x, y = arrays["x"], arrays["y"]
    if x.dtype.name not in _FLOAT_DTYPES.values():
        raise DatasetFormatError(f"x is {x.dtype}; use float32 (or float16, float64, uint8)")
    if y.dtype.name not in _LABEL_DTYPES.values():
        raise DatasetFormatError(f"y is {y.dtype}; labels are integers (int64, int32, int16 or uint8)")
    if len(x.shape) not in (2, 4) or 0 in x.shape:
        raise DatasetFormatError(f"x has shape {list(x.shape)}; use [samples, features] or [samples, C, H, W]")
    if len(y.shape) != 1 or y.shape[0] != x.shape[0]:
        raise DatasetFormatError(f"y has shape {list(y.shape)}; it needs one label per sample: [{x.shape[0]}]")
    if x.shape[0] < 2:
        raise DatasetFormatError("x holds fewer than 2 samples; training and validation need one each")
    for name, array in (("x", x), ("y", y)):
        if array.offset + array.row_bytes * array.shape[0] > size:
            raise DatasetFormatError(f"{name}'s data runs past the end of the file: truncated")
    return x, y


def _safetensors_arrays(handle: BinaryIO, size: int) -> dict[str, StoredArray]:
    handle.seek(0)
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise DatasetFormatError("not a safetensors file: shorter than its header length")
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > min(MAX_HEADER_BYTES, size - 8):
        raise DatasetFormatError(f"not a safetensors file: a header of {header_bytes} bytes")
    try:
        header = json_loads_bounded(handle.read(header_bytes), where="header")
    except SpecError as exc:
        raise DatasetFormatError(f"not a safetensors file: its header {exc.message}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise DatasetFormatError("not a safetensors file: its header is not an object")
    header.pop("__metadata__", None)
    if set(header) != {"x", "y"}:
        raise DatasetFormatError(f"holds tensors {sorted(header)}; it must hold exactly x and y")
    import numpy as np

    out = {}
    dtypes = {**_FLOAT_DTYPES, **_LABEL_DTYPES}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(s) for s in shape)
        except (KeyError, TypeError, ValueError):
            raise DatasetFormatError(f"tensor {name}'s header entry is malformed") from None
        if dtype not in dtypes:
            raise DatasetFormatError(f"{name} is {dtype}; use one of {', '.join(dtypes)}")
        array = StoredArray(8 + header_bytes + int(begin), np.dtype(dtypes[dtype]).newbyteorder("<"), shape)
        if end - begin != array.row_bytes * (shape[0] if shape else 1) or begin < 0:
            raise DatasetFormatError(f"{name}'s data offsets do not match its shape and dtype")
        out[name] = array
    return out


def _npz_arrays(handle: BinaryIO, size: int) -> dict[str, StoredArray]:
    import numpy as np

    handle.seek(0)
    try:
        archive = zipfile.ZipFile(handle)
        members = {info.filename: info for info in archive.infolist()}
    except (zipfile.BadZipFile, OSError) as exc:
        raise DatasetFormatError(f"not an .npz file (a zip of .npy files): {exc}") from None
    if set(members) != {"x.npy", "y.npy"}:
        raise DatasetFormatError(
            f"holds {sorted(members)}; it must hold exactly x.npy and y.npy (numpy.savez(f, x=..., y=...))"
        )
    out = {}
    for name, info in members.items():
        if info.compress_type != zipfile.ZIP_STORED:
            raise DatasetFormatError(f"{name} is compressed; save with numpy.savez, not savez_compressed")
        handle.seek(info.header_offset)
        local = handle.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise DatasetFormatError(f"{name}'s zip entry is malformed")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        handle.seek(start)
        header = io.BytesIO(handle.read(min(MAX_HEADER_BYTES, info.file_size)))
        try:
            version = np.lib.format.read_magic(header)
            reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = reader(header, max_header_size=MAX_HEADER_BYTES)
        except ValueError as exc:
            raise DatasetFormatError(f"{name} is not a .npy array: {exc}") from None
        if dtype.hasobject or fortran or dtype.byteorder == ">":
            raise DatasetFormatError(f"{name} must be a C-ordered little-endian numeric array (no objects)")
        out[name.removesuffix(".npy")] = StoredArray(start + header.tell(), dtype, tuple(shape))
    return out


def _inspect_tokenizer(handle: BinaryIO, size: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    if size > MAX_TOKENIZER_BYTES:
        raise DatasetFormatError(f"a tokenizer.json of {size} bytes is more than {MAX_TOKENIZER_BYTES}")
    handle.seek(0)
    try:
        tokenizer = Tokenizer.from_str(handle.read(size).decode("utf-8"))
    except Exception as exc:  # tokenizers raises its own Exception subclass for any malformed file
        raise DatasetFormatError(f"not a Hugging Face tokenizer.json: {exc}") from None
    return {"kind": "tokenizer", "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}
