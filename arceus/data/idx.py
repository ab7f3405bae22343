"""A strict reader for the IDX format of the MNIST files (http://yann.lecun.com/exdb/mnist/)."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np

_UBYTE = 0x08


class IdxError(ValueError):
    """An IDX file is malformed or not what was expected."""


def read_idx_ubyte(path: Path, *, ndim: int) -> np.ndarray:
    """Read an unsigned-byte IDX file with `ndim` dimensions (3 for images, 1 for labels)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise IdxError(f"{path}: cannot read: {exc}") from exc
    if len(raw) < 4:
        raise IdxError(f"{path}: too short for an IDX header ({len(raw)} bytes)")
    zero, dtype, dims = int.from_bytes(raw[0:2], "big"), raw[2], raw[3]
    if zero != 0 or dtype != _UBYTE or dims != ndim:
        raise IdxError(
            f"{path}: bad magic number 0x{raw[:4].hex()}; expected 0x000008{ndim:02x} "
            f"(unsigned bytes, {ndim} dimensions)"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxError(f"{path}: header truncated: {len(raw)} bytes, need {header}")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + math.prod(shape)
    if len(raw) != expected:
        raise IdxError(f"{path}: dimensions {list(shape)} need {expected:,} bytes, file has {len(raw):,}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)
