"""Checkpoint files: named tensors as safetensors, identified by their SHA-256, and merged as a stream.

safetensors holds only raw tensors and a JSON header, so loading a checkpoint can never run code
(unlike `torch.load` of a pickle): what a contributor's agent downloads is data and nothing else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

# Names of optimizer-state entries start with this; the rest of a stage checkpoint are its weights.
OPTIMIZER_PREFIX = "optimizer."
# safetensors refuses headers above 100 MB; a larger one is no checkpoint of ours.
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, or not the one that was asked for."""


def encode_checkpoint(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return save({name: t.contiguous() for name, t in tensors.items()}, metadata=metadata)


def checkpoint_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_checkpoint(data: bytes, *, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; with `sha256`, the bytes must hash to it first."""
    if sha256 is not None:
        actual = checkpoint_digest(data)
        if actual != sha256:
            raise CheckpointError(f"checkpoint content hash is {actual}, expected {sha256}: corrupt or replaced")
    try:
        return load(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"not a valid safetensors checkpoint: {exc}") from exc


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
        header = json.loads(handle.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"not a valid safetensors checkpoint: its header is no JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError("not a valid safetensors checkpoint: its header is no JSON object")
    return _HEADER_LENGTH + length, header


def file_digest(handle: BinaryIO) -> str:
    """SHA-256 (hex) of a whole file, read a chunk at a time."""
    handle.seek(0)
    digest = hashlib.sha256()
    while chunk := handle.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def merged_checkpoint(
    sources: Sequence[BinaryIO], *, keep: Callable[[str], bool], metadata: dict[str, str]
) -> tuple[int, Iterator[bytes]]:
    """One safetensors file holding the tensors `keep` selects from several (seekable, already verified)
    files, as its length and a stream of chunks. The header is built from the sources' headers and the data
    copied range by range, so the memory it takes does not grow with the model."""
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
    for _, _, name, info in entries:
        begin, end = info["data_offsets"]
        merged[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    header_bytes = json.dumps(merged, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # tensor data starts 8-byte aligned
    prefix = len(header_bytes).to_bytes(_HEADER_LENGTH, "little") + header_bytes

    def chunks() -> Iterator[bytes]:
        yield prefix
        for handle, start, _, info in entries:
            begin, end = info["data_offsets"]
            handle.seek(start + begin)
            remaining = end - begin
            while remaining:
                chunk = handle.read(min(CHUNK_BYTES, remaining))
                if not chunk:
                    raise CheckpointError("a checkpoint file ended before its tensor data did")
                remaining -= len(chunk)
                yield chunk

    return len(prefix) + offset, chunks()
