"""Lossy encodings for float32 activations and gradients in transit: fp16, bf16, int8, top-k.

Pure torch + numpy (no grpc): `encode` turns a float32 tensor into an `Encoded` payload of raw
little-endian buffers, `decode` validates a payload's sizes and values with numpy before torch sees it
and returns a float32 tensor of the original shape. Payloads are memoryviews of the encoded arrays (no
`tobytes` copy); "fp32" is a view of the tensor itself, so a caller must not write to the tensor while
its payload may still be serialized (the data plane sends tensors autograd just made and never writes
them again).

- "fp32": the raw bytes, as the uncompressed path sends them.
- "fp16" / "bf16": the values rounded to half precision (2 bytes each).
- "int8": blockwise absmax quantisation over the flattened tensor: each block of `block_size` values
  shares one float32 scale = absmax / 127 and each value travels as round(x / scale) in [-127, 127];
  the last block may be partial. Scales are float32 because fp16 would flush tiny gradients to 0.
- "topk": the k largest-magnitude values (float32) and their strictly increasing int32 flat indices;
  the rest decode to 0. Pair it with `ErrorFeedback` so the dropped mass is sent later, not lost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from arceus.contracts.transfer import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from arceus.wire.codec import DEFAULT_MAX_BYTES, MAX_RANK, Payload, TensorValidationError

ENCODINGS = ("fp32", "fp16", "bf16", "int8", "topk")
_INT8_CHUNK = 1 << 19  # values the int8 encoder scales per pass
_F32, _F16, _U16, _I32 = np.dtype("<f4"), np.dtype("<f2"), np.dtype("<u2"), np.dtype("<i4")


@dataclass(frozen=True)
class Encoded:
    """One tensor's payload; `shape` is the decoded float32 tensor's shape."""

    encoding: str
    shape: tuple[int, ...]
    data: Payload
    scales: Payload = b""  # int8: one float32 per block
    indices: Payload = b""  # topk: one int32 per value in `data`
    block_size: int = 0  # int8 only

    @property
    def nbytes(self) -> int:
        """Bytes of payload on the wire (headers aside)."""
        return len(self.data) + len(self.scales) + len(self.indices)


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not (
        MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
    ):
        raise TensorValidationError(
            f"int8 block_size must be an integer in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}"
        )
    return block_size


def check_topk_ratio(ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise TensorValidationError(f"topk ratio must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def topk_count(numel: int, ratio: float) -> int:
    """How many values a top-k payload of a `numel`-element tensor keeps (at least one, if any)."""
    return min(numel, max(1, math.ceil(numel * ratio)))


def encode(tensor: torch.Tensor, encoding: str, *, block_size: int = 64, topk_ratio: float = 0.1) -> Encoded:
    """Encode a float32 tensor; raises TensorValidationError for other dtypes or unknown encodings."""
    if tensor.dtype != torch.float32:
        raise TensorValidationError(f"only float32 tensors can be compressed, got {tensor.dtype}")
    t = tensor.detach().to("cpu").contiguous()
    shape = tuple(t.shape)
    if encoding == "fp32":
        return Encoded("fp32", shape, _view(t.numpy(), _F32))
    if encoding == "fp16":
        return Encoded("fp16", shape, _view(t.to(torch.float16).numpy(), _F16))
    if encoding == "bf16":
        return Encoded("bf16", shape, _view(t.to(torch.bfloat16).view(torch.uint16).numpy(), _U16))
    if encoding == "int8":
        return _encode_int8(t, check_block_size(block_size))
    if encoding == "topk":
        return _encode_topk(t, check_topk_ratio(topk_ratio))
    raise TensorValidationError(f"unknown encoding {encoding!r}; known: {', '.join(ENCODINGS)}")


def _encode_int8(t: torch.Tensor, block_size: int) -> Encoded:
    flat = t.reshape(-1)
    full = flat.numel() // block_size * block_size
    codes = torch.empty(flat.numel(), dtype=torch.int8)
    # Full blocks as [blocks, block_size] views and the partial last block apart: no padded copy.
    parts = [
        (values, out)
        for values, out in (
            (flat[:full].view(-1, block_size), codes[:full].view(-1, block_size)),
            (flat[full:].view(1, -1), codes[full:].view(1, -1)),
        )
        if values.numel()
    ]
    absmax = [torch.maximum(v.amax(dim=1), v.amin(dim=1).neg_()) for v, _ in parts]  # no |x| temporary
    scales = torch.cat(absmax) / 127.0 if parts else torch.zeros(0)
    if not bool(torch.isfinite(scales).all()):  # amax propagates inf and nan
        raise TensorValidationError("int8 encoding needs finite values; the tensor holds inf or nan")
    for (values, out), m in zip(parts, absmax, strict=True):
        # Multiplying by 127 / absmax keeps |code| <= 127; an all-zero block gets factor 0, codes 0.
        factor = torch.where(m > 0, 127.0 / m, 0.0).unsqueeze(1)
        # A chunk at a time through one float32 scratch: a tensor-sized temporary costs more in page
        # faults than the arithmetic itself.
        rows = max(1, _INT8_CHUNK // block_size)
        scratch = torch.empty(min(rows, len(values)), values.shape[1])
        for r in range(0, len(values), rows):
            chunk = scratch[: min(rows, len(values) - r)]
            out[r : r + rows].copy_(torch.mul(values[r : r + rows], factor[r : r + rows], out=chunk).round_())
    return Encoded(
        "int8", tuple(t.shape), _view(codes.numpy(), np.dtype("i1")), scales=_view(scales.numpy(), _F32),
        block_size=block_size,
    )


def _encode_topk(t: torch.Tensor, ratio: float) -> Encoded:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return Encoded("topk", tuple(t.shape), b"", indices=b"")
    k = topk_count(flat.numel(), ratio)
    indices = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    return Encoded(
        "topk", tuple(t.shape), _view(flat[indices].numpy(), _F32),
        indices=_view(indices.to(torch.int32).numpy(), _I32),
    )


def decode(
    encoding: str,
    shape: Sequence[int],
    data: Payload,
    *,
    scales: Payload = b"",
    indices: Payload = b"",
    block_size: int = 0,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> torch.Tensor:
    """Validate a payload and decode it into a new float32 CPU tensor of `shape`.

    `max_bytes` bounds the decoded tensor (numel * 4), checked before anything is allocated.
    """
    shape = [int(d) for d in shape]
    numel = _check_shape(shape, max_bytes)
    if encoding not in ENCODINGS:
        raise TensorValidationError(f"unknown encoding {encoding!r}; known: {', '.join(ENCODINGS)}")
    if encoding != "int8" and (scales or block_size):
        raise TensorValidationError(f"{encoding} payloads carry no scales or block_size")
    if encoding != "topk" and indices:
        raise TensorValidationError(f"{encoding} payloads carry no indices")
    if encoding in ("fp32", "fp16", "bf16"):
        wire = {"fp32": _F32, "fp16": _F16, "bf16": _U16}[encoding]
        _expect(len(data), numel * wire.itemsize, f"{encoding} data", shape)
        array = np.frombuffer(data, dtype=wire).astype(wire.newbyteorder("="), copy=True)
        values = torch.from_numpy(array)
        if encoding == "bf16":
            values = values.view(torch.bfloat16)
        return values.to(torch.float32).reshape(shape)
    if encoding == "int8":
        return _decode_int8(shape, numel, data, scales, block_size)
    return _decode_topk(shape, numel, data, indices)


def _decode_int8(shape: list[int], numel: int, data: Payload, scales: Payload, block_size: int) -> torch.Tensor:
    check_block_size(block_size)
    blocks = -(-numel // block_size)
    _expect(len(data), numel, "int8 data", shape)
    _expect(len(scales), blocks * 4, f"int8 scales (one float32 per block of {block_size})", shape)
    scale_array = np.frombuffer(scales, dtype=_F32).astype(np.float32)
    if not (np.isfinite(scale_array).all() and (scale_array >= 0).all()):
        raise TensorValidationError("int8 scales must be finite and >= 0")
    if not numel:
        return torch.zeros(shape)
    # The codes are read where they arrived (a view); converted once, then scaled in place.
    values = torch.frombuffer(data, dtype=torch.int8).to(torch.float32)
    scale = torch.from_numpy(scale_array)
    full = numel // block_size * block_size
    values[:full].view(-1, block_size).mul_(scale[: full // block_size].unsqueeze(1))
    if full < numel:
        values[full:].mul_(scale[-1])
    return values.reshape(shape)


def _decode_topk(shape: list[int], numel: int, data: Payload, indices: Payload) -> torch.Tensor:
    if len(indices) % 4:
        raise TensorValidationError(f"topk indices must be whole int32s, got {len(indices)} bytes")
    k = len(indices) // 4
    if k > numel:
        raise TensorValidationError(f"topk payload has {k} values for a tensor of {numel} elements")
    _expect(len(data), k * 4, f"topk values (one float32 per index, {k} indices)", shape)
    index_array = np.frombuffer(indices, dtype=_I32).astype(np.int64)
    if k and (index_array[0] < 0 or index_array[-1] >= numel or (np.diff(index_array) <= 0).any()):
        raise TensorValidationError(f"topk indices must be strictly increasing and in [0, {numel})")
    out = torch.zeros(numel, dtype=torch.float32)
    out[torch.from_numpy(index_array)] = torch.from_numpy(np.frombuffer(data, dtype=_F32).astype(np.float32))
    return out.reshape(shape)


def _check_shape(shape: list[int], max_bytes: int) -> int:
    if len(shape) > MAX_RANK:
        raise TensorValidationError(f"tensor rank {len(shape)} is above the limit of {MAX_RANK}")
    if any(d < 0 for d in shape):
        raise TensorValidationError(f"tensor shape {shape} has a negative dimension")
    numel = math.prod(shape)
    if numel * 4 > max_bytes:
        raise TensorValidationError(
            f"float32 tensor of shape {shape} needs {numel * 4:,} bytes, above the limit of {max_bytes:,} bytes"
        )
    return numel


def _expect(got: int, want: int, what: str, shape: list[int]) -> None:
    if got != want:
        raise TensorValidationError(f"{what} for shape {shape} must be exactly {want:,} bytes, got {got:,}")


def _view(array: np.ndarray, wire: np.dtype) -> memoryview:
    """The C-contiguous `array`'s bytes in `wire` order: no copy but on big-endian hosts (a byte swap)."""
    return memoryview(array.astype(wire, copy=False).reshape(-1)).cast("B")


class ErrorFeedback:
    """The residual of one lossy stream (one neighbour, kind and micro-batch slot).

    Each `encode` sends `x + residual` and keeps what the encoding dropped, so over many steps the
    receiver gets the full sum. A residual of another shape (a smaller last batch) is dropped.
    """

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None

    def encode(self, tensor: torch.Tensor, encoding: str, *, block_size: int = 64, topk_ratio: float = 0.1) -> Encoded:
        corrected = tensor.detach().to("cpu", torch.float32)
        if self.residual is not None and self.residual.shape == corrected.shape:
            corrected = corrected + self.residual
        encoded = encode(corrected, encoding, block_size=block_size, topk_ratio=topk_ratio)
        self.residual = corrected - decode_payload(encoded)
        return encoded


def decode_payload(encoded: Encoded, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    return decode(
        encoded.encoding, encoded.shape, encoded.data, scales=encoded.scales, indices=encoded.indices,
        block_size=encoded.block_size, max_bytes=max_bytes,
    )
