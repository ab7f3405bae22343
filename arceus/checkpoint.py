"""Checkpoint files: named tensors as safetensors, identified by their SHA-256, loaded and saved with torch
(read, merged and cut as bytes without torch: `arceus.safetensors_file`).

safetensors holds only raw tensors and a JSON header, so loading a checkpoint can never run code
(unlike `torch.load` of a pickle): what a contributor's agent downloads is data and nothing else.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from arceus.safetensors_file import (
    CHUNK_BYTES,
    CheckpointError,
    file_digest,
    file_entries,
    header_handle,
    header_prefix,
)


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


def checkpoint_views(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `data` as views of its bytes, not copies (a joining replica loads
    its sibling's state from the one buffer it received it into: decode_checkpoint's copy of every tensor would take
    a second state's memory). The header is checked against the bytes as a file's is (`file_entries`); the views
    live as long as they, and change with `data`."""
    entries = file_entries(header_handle(data), len(data))
    views = {}
    for name, entry in entries.items():
        dtype = _TORCH_DTYPES[entry.dtype]
        count = math.prod(entry.shape)
        empty = torch.empty(0, dtype=dtype)  # frombuffer refuses a count of 0
        flat = torch.frombuffer(data, dtype=dtype, count=count, offset=entry.begin) if count else empty
        views[name] = flat.reshape(entry.shape)
    return views


# torch dtype -> safetensors dtype name
_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


def stored_layout(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[torch.dtype, list[int]]:
    """A tensor's dtype and shape, without loading it where the mapping can tell (a StateFile, a gathered
    tensor-parallel state); otherwise from the tensor itself."""
    shape_of, dtype_of = getattr(tensors, "shape_of", None), getattr(tensors, "dtype_of", None)
    if shape_of is None or dtype_of is None:
        tensor = tensors[name]
        return tensor.dtype, list(tensor.shape)
    return dtype_of(name), shape_of(name)


def copy_stored(tensors: Mapping[str, torch.Tensor], name: str, out: torch.Tensor) -> None:
    """Copy the stored tensor `name` into `out` (of its shape; a dtype it widens to). A mapping that reads a file
    (a `StateFile`) reads straight into `out` where it is a contiguous CPU tensor of the stored dtype: no tensor
    of the file's is made beside it (a resumed stage's peak held one more, the largest, and the heap the holes
    they left). Otherwise the stored tensor is copied in."""
    read_into = getattr(tensors, "read_into", None)
    if read_into is not None and out.device.type == "cpu" and out.is_contiguous() and (
        stored_layout(tensors, name)[0] == out.dtype
    ):
        read_into(name, out)
    else:
        out.copy_(tensors[name])


def state_chunks(
    tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> tuple[int, Iterator[memoryview]]:
    """A safetensors file of `tensors` as its length and a stream of chunks (the header, then each tensor's
    bytes in slices of at most CHUNK_BYTES, views of the tensors' own memory): writing a stage's state
    takes one chunk of memory, not a copy of the state. A mapping that loads lazily (`StateFile`, a gathered
    state) is read one tensor at a time. The tensors must not change while it streams."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in tensors:
        dtype, shape = stored_layout(tensors, name)
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    prefix = header_prefix(header)

    def chunks() -> Iterator[memoryview]:
        yield memoryview(prefix)
        for name in tensors:
            tensor = tensors[name]
            if not tensor.numel():
                continue
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # a copy only off-CPU
            data = memoryview(flat.numpy())
            for start in range(0, len(data), CHUNK_BYTES):
                yield data[start : start + CHUNK_BYTES]

    return len(prefix) + offset, chunks()


class StateFile(Mapping[str, torch.Tensor]):
    """A safetensors checkpoint file on disk, read lazily: a tensor is read (plain reads, not a memory map,
    whose touched pages would count toward the process's resident memory) when it is asked for, so a stage
    loads its state one tensor at a time. The file stays open while this lives, also once it is unlinked."""

    def __init__(self, path: Path, *, sha256: str | None = None) -> None:
        self._handle = path.open("rb")
        self._lock = threading.Lock()
        try:
            if sha256 is not None:
                actual = file_digest(self._handle)
                if actual != sha256:
                    raise CheckpointError(
                        f"checkpoint content hash is {actual}, expected {sha256}: corrupt or replaced"
                    )
            self._entries = file_entries(self._handle, path.stat().st_size)
        except BaseException:
            self._handle.close()
            raise

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        tensor = torch.empty(entry.shape, dtype=_TORCH_DTYPES[entry.dtype])
        self.read_into(name, tensor)
        return tensor

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read tensor `name` into `out`, a contiguous CPU tensor of its dtype and shape (ValueError otherwise)."""
        entry = self._entries[name]
        if out.device.type != "cpu" or out.dtype != _TORCH_DTYPES[entry.dtype] or list(out.shape) != entry.shape:
            raise ValueError(f"checkpoint tensor {name} is {entry.dtype} {entry.shape}; cannot read it into "
                             f"{out.dtype} {list(out.shape)} on {out.device}")
        if not out.is_contiguous():
            raise ValueError(f"checkpoint tensor {name} can only be read into a contiguous tensor")
        if not out.numel():
            return
        buffer = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
        with self._lock:
            self._handle.seek(entry.begin)
            read = self._handle.readinto(buffer)
        if read != entry.end - entry.begin:
            raise CheckpointError(f"checkpoint tensor {name} ends early: {read} of {entry.end - entry.begin} bytes")

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape_of(self, name: str) -> list[int]:
        """A tensor's shape, without loading it."""
        return list(self._entries[name].shape)

    def dtype_of(self, name: str) -> torch.dtype:
        """A tensor's dtype, without loading it."""
        return _TORCH_DTYPES[self._entries[name].dtype]


