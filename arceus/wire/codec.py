"""Encode tensors as (dtype, shape, raw little-endian C-order bytes) and decode them with validation.

Bytes from the network are never unpickled: decoding is `numpy.frombuffer` on a whitelisted dtype
after checking that the shape is sane and that the byte count matches it exactly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

MAX_RANK = 8
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

# wire name -> (torch dtype, little-endian numpy dtype carrying the same bits)
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    # numpy has no bfloat16: its bits travel as uint16 and are reinterpreted by torch.
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "int8": (torch.int8, np.dtype("i1")),
}
_WIRE_NAMES = {torch_dtype: name for name, (torch_dtype, _) in _DTYPES.items()}
SUPPORTED_DTYPES = tuple(_DTYPES)
# A payload's bytes: `bytes`, or a byte-format memoryview of an encoded array or of received bytes.
Payload = bytes | memoryview


# torch warns once per process that a view of immutable bytes is writable; decode(copy=False) means
# exactly that, so the one warning is spent here, silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class TensorValidationError(ValueError):
    """A tensor payload is malformed or outside the receiver's limits."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _WIRE_NAMES[dtype]
    except KeyError:
        raise TensorValidationError(
            f"dtype {dtype} cannot be sent; supported: {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def itemsize(dtype: str) -> int:
    return _numpy_dtype(dtype).itemsize


def encode(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A CPU copy of `tensor` as (dtype name, shape, little-endian C-order bytes)."""
    name = dtype_name(tensor.dtype)
    t = tensor.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    array = t.numpy().astype(_DTYPES[name][1], copy=False)  # byte-swaps only on big-endian hosts
    return name, list(t.shape), array.tobytes(order="C")


def validate_payload(
    dtype: str, shape: Sequence[int], nbytes: int, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> None:
    """Check a payload's header against its byte count and the receiver's byte limit."""
    if nbytes > max_bytes:
        raise TensorValidationError(
            f"tensor payload is {nbytes:,} bytes, above the limit of {max_bytes:,} bytes"
        )
    size = _numpy_dtype(dtype).itemsize
    if len(shape) > MAX_RANK:
        raise TensorValidationError(f"tensor rank {len(shape)} is above the limit of {MAX_RANK}")
    for axis, dim in enumerate(shape):
        if dim < 0:
            raise TensorValidationError(f"tensor shape {list(shape)} has a negative dimension at axis {axis}")
    expected = math.prod(shape) * size
    if expected > max_bytes:
        raise TensorValidationError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs {expected:,} bytes, "
            f"above the limit of {max_bytes:,} bytes"
        )
    if nbytes != expected:
        raise TensorValidationError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs exactly {expected:,} bytes, "
            f"got {nbytes:,}"
        )


def decode(
    dtype: str, shape: Sequence[int], data: Payload, *, max_bytes: int = DEFAULT_MAX_BYTES, copy: bool = True
) -> torch.Tensor:
    """Validate and decode a payload into a new CPU tensor that owns its memory.

    `copy=False` (a little-endian host) returns a view of `data` instead: no copy of the payload, for
    tensors nobody writes to (pushed activations, gradients, labels). Writing to it would write into
    the immutable `data`.
    """
    shape = [int(d) for d in shape]
    validate_payload(dtype, shape, len(data), max_bytes=max_bytes)
    torch_dtype, wire_dtype = _DTYPES[dtype]
    if not copy and wire_dtype.isnative and len(data):
        return torch.frombuffer(data, dtype=torch_dtype).reshape(shape)
    # astype to the native byte order copies, so the tensor never aliases the (read-only) message buffer.
    array = np.frombuffer(data, dtype=wire_dtype).astype(wire_dtype.newbyteorder("="), copy=True)
    tensor = torch.from_numpy(array).reshape(shape)
    return tensor.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else tensor


def _numpy_dtype(dtype: str) -> np.dtype:
    try:
        return _DTYPES[dtype][1]
    except (KeyError, TypeError):
        raise TensorValidationError(
            f"unsupported tensor dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}"
        ) from None
