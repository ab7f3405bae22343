"""A safetensors file as bytes: its JSON header read and checked against the file, and files merged or cut by
copying tensors' byte ranges. No torch: the control plane checks and serves checkpoints with this alone
(`arceus.checkpoint` loads and saves tensors)."""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from arceus.errors import SpecError
from arceus.json_input import json_loads_bounded

# Names of optimizer-state entries start with this; the rest of a stage checkpoint are its weights.
OPTIMIZER_PREFIX = "optimizer."
# A buffer training updates (arceus.model.buffers), in a stage's state (checkpoints, a joiner's copy of a sibling's).
BUFFER_PREFIX = "buffer."
# safetensors refuses headers above 100 MB; a larger one is no checkpoint of ours.
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, or not the one that was asked for."""


class StageStateError(CheckpointError):
    """A stage's state file is not what that stage must hold (or never arrived): its agent's fault."""

    def __init__(self, message: str, *, stage_index: int) -> None:
        super().__init__(f"stage {stage_index}: {message}")
        self.stage_index = stage_index


# Bytes read or sent at a time when checkpoint files are copied: memory stays at one chunk.
CHUNK_BYTES = 4 * 1024 * 1024
_HEADER_LENGTH = 8  # a safetensors file starts with its JSON header's length, u64 little-endian


def read_header(handle: BinaryIO) -> tuple[int, dict[str, Any]]:
    """(where the tensor data starts, the parsed JSON header) of a safetensors file open for reading."""
    handle.seek(0)
    prefix = handle.read(_HEADER_LENGTH)
    if len(prefix) != _HEADER_LENGTH:
        raise CheckpointError("not a valid safetensors checkpoint: shorter than its header length")
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"not a valid safetensors checkpoint: a {length:,}-byte header")
    try:
        header = json_loads_bounded(handle.read(length), where="header")
    except SpecError as exc:
        raise CheckpointError(f"not a valid safetensors checkpoint: its header {exc.message}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"not a valid safetensors checkpoint: its header is no JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError("not a valid safetensors checkpoint: its header is no JSON object")
    return _HEADER_LENGTH + length, header


def header_handle(data: bytes | bytearray) -> BinaryIO:
    """A handle on the header of a safetensors file held in `data` (its bytes up to the tensors' data, for
    `read_header` and `file_entries`, given len(data) as the file's size): not a copy of the file, as io.BytesIO(data)
    is of a bytearray (a joining replica's received state: its second copy of a whole stage's state)."""
    length = int.from_bytes(data[:_HEADER_LENGTH], "little")
    return io.BytesIO(memoryview(data)[: _HEADER_LENGTH + (length if length <= MAX_HEADER_BYTES else 0)])


def file_digest(handle: BinaryIO) -> str:
    """SHA-256 (hex) of a whole file, read a chunk at a time."""
    handle.seek(0)
    digest = hashlib.sha256()
    while chunk := handle.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def merged_checkpoint(
    sources: Sequence[BinaryIO],
    *,
    keep: Callable[[str], bool],
    metadata: dict[str, str],
    rename: Callable[[str], str] = lambda name: name,
    transposed: Callable[[str], bool] = lambda name: False,
) -> tuple[int, Iterator[bytes]]:
    """One safetensors file holding the tensors `keep` selects from several (seekable, already verified)
    files, each under its `rename`d name, the 2-D ones `transposed` names (by their names in the sources)
    transposed, as its length and a stream of chunks. The header is built from the sources' headers and the data
    copied range by range, so the memory it takes does not grow with the model (a transposed tensor is held
    whole while it is copied)."""
    entries: list[tuple[BinaryIO, int, str, dict[str, Any]]] = []
    for handle in sources:
        start, header = read_header(handle)
        tensors = sorted(
            ((name, info) for name, info in header.items() if name != "__metadata__" and keep(name)),
            key=lambda item: item[1]["data_offsets"][0],
        )
        entries += [(handle, start, name, info) for name, info in tensors]
    merged: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    spans: list[_Span] = []
    for handle, start, name, info in entries:
        begin, end = info["data_offsets"]
        entry = Entry(info["dtype"], info["shape"], start + begin, start + end)
        span = _span(handle, entry, transposed(name))
        merged[rename(name)] = {
            "dtype": entry.dtype, "shape": span.shape, "data_offsets": [offset, offset + end - begin]
        }
        offset += end - begin
        spans.append(span)
    prefix = header_prefix(merged)
    return len(prefix) + offset, _copied(prefix, spans)


def sliced_checkpoint(
    source: BinaryIO,
    size: int,
    names: Mapping[str, str],
    metadata: dict[str, str] | None = None,
    transposed: Callable[[str], bool] = lambda name: False,
) -> tuple[int, Iterator[bytes]]:
    """A safetensors file holding some tensors of the (seekable) safetensors file `source` of `size` bytes, each
    under a new name (`names`: new name -> its name in `source`), the 2-D ones `transposed` names (by new name)
    transposed, as its length and a stream of chunks. Laid out as safetensors' own `save` lays out tensors of one
    dtype (in the order of their names), so the same tensors give the same bytes whichever file they are cut from.
    The source's header is checked (`file_entries`) and each tensor's bytes are read by range, a chunk at a time:
    the memory it takes does not grow with either file (a transposed tensor is held whole while it is copied)."""
    entries = file_entries(source, size)
    absent = sorted(old for old in names.values() if old not in entries)
    if absent:
        raise CheckpointError(f"the weights lack {absent[0]} ({len(absent)} tensors missing)")
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    spans: list[_Span] = []
    for new, old in sorted(names.items()):
        entry = entries[old]
        span = _span(source, entry, transposed(new))
        header[new] = {
            "dtype": entry.dtype, "shape": span.shape, "data_offsets": [offset, offset + entry.end - entry.begin]
        }
        offset += entry.end - entry.begin
        spans.append(span)
    prefix = header_prefix(header)
    return len(prefix) + offset, _copied(prefix, spans)


@dataclass(frozen=True)
class _Span:
    """A tensor's bytes [begin, end) in `handle`, copied as they are, or (`rows` set) as a [rows, len / rows]
    matrix transposed: then `shape` is the transposed one."""

    handle: BinaryIO
    begin: int
    end: int
    shape: list[int]
    itemsize: int
    rows: int | None = None


def _span(handle: BinaryIO, entry: Entry, transpose: bool) -> _Span:
    if not transpose:
        return _Span(handle, entry.begin, entry.end, entry.shape, DTYPE_BYTES[entry.dtype])
    if len(entry.shape) != 2:
        raise CheckpointError(f"a {entry.shape} tensor is to be transposed; only a matrix can be")
    rows, columns = entry.shape
    return _Span(handle, entry.begin, entry.end, [columns, rows], DTYPE_BYTES[entry.dtype], rows)


def _copied(prefix: bytes, spans: Sequence[_Span]) -> Iterator[bytes]:
    """`prefix`, then each span's bytes, read a chunk at a time (a transposed one whole)."""
    yield prefix
    for span in spans:
        span.handle.seek(span.begin)
        remaining = span.end - span.begin
        if span.rows is not None:
            data = span.handle.read(remaining)
            if len(data) != remaining:
                raise CheckpointError("a checkpoint file ended before its tensor data did")
            # Only the elements' order changes: they move as unsigned integers of their width, bits untouched.
            import numpy as np  # here: the control plane's processes import this module, and seldom transpose

            matrix = np.frombuffer(data, dtype=f"<u{span.itemsize}").reshape(span.rows, -1)
            yield np.ascontiguousarray(matrix.T).tobytes()
            continue
        while remaining:
            chunk = span.handle.read(min(CHUNK_BYTES, remaining))
            if not chunk:
                raise CheckpointError("a checkpoint file ended before its tensor data did")
            remaining -= len(chunk)
            yield chunk


def header_prefix(header: dict[str, Any]) -> bytes:
    """The length and JSON header of a safetensors file, padded so the tensor data starts 8-byte aligned."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(_HEADER_LENGTH, "little") + encoded


# safetensors dtype name -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its dtype (safetensors' name, e.g. "F32"), shape and absolute byte range."""

    dtype: str
    shape: list[int]
    begin: int
    end: int


def tensor_layouts(handle: BinaryIO, file_size: int) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's (dtype, shape) as a safetensors file's header describes it, in the order of its data, the
    header checked against the file (`file_entries`): read from the header alone, never loading a tensor."""
    entries = sorted(file_entries(handle, file_size).items(), key=lambda item: item[1].begin)
    return {name: (entry.dtype, entry.shape) for name, entry in entries}


def file_entries(handle: BinaryIO, file_size: int) -> dict[str, Entry]:
    """Every tensor a safetensors file's header describes, checked against the file: a known dtype, a shape
    of non-negative integers, data offsets that hold exactly its bytes, and tensors that tile the data from
    the header to the end of the file (no byte that belongs to no tensor: a file cannot declare small
    tensors and carry more)."""
    start, header = read_header(handle)
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            itemsize = DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"not a valid safetensors checkpoint: tensor {name!r} is described as {info!r}"
            ) from None
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"not a valid safetensors checkpoint: tensor {name!r} has shape {shape!r}")
        nbytes = math.prod(shape) * itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and begin >= 0 and end - begin == nbytes
                and start + end <= file_size):
            raise CheckpointError(
                f"not a valid safetensors checkpoint: tensor {name!r} of {nbytes} bytes at offsets {[begin, end]}"
            )
        entries[name] = Entry(dtype, list(shape), start + begin, start + end)
    covered = start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != covered:
            raise CheckpointError(
                f"not a valid safetensors checkpoint: tensor {name!r} starts at data offset {entry.begin - start}, "
                f"expected {covered - start} (tensors must tile the data, without gaps or overlaps)"
            )
        covered = entry.end
    if covered != file_size:
        raise CheckpointError(
            f"not a valid safetensors checkpoint: its tensors hold {covered - start} bytes of data, but the file "
            f"carries {file_size - start}"
        )
    return entries
