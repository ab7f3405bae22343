"""Thin conversions between torch tensors and the `arceus.v1.Tensor` message."""

from __future__ import annotations

import torch

from arceus.v1 import stage_pb2
from arceus.wire import codec, compression


def to_proto(tensor: torch.Tensor) -> stage_pb2.Tensor:
    dtype, shape, data = codec.encode(tensor)
    return stage_pb2.Tensor(dtype=dtype, shape=shape, data=data)


def encoded_to_proto(encoded: compression.Encoded) -> stage_pb2.Tensor:
    """A compressed float32 payload; "fp32" leaves `encoding` unset, so it is the plain message."""
    if encoded.encoding == "fp32":
        return stage_pb2.Tensor(dtype="float32", shape=encoded.shape, data=encoded.data)
    return stage_pb2.Tensor(
        dtype="float32",
        shape=encoded.shape,
        data=encoded.data,
        encoding=encoded.encoding,
        scales=encoded.scales,
        block_size=encoded.block_size,
        indices=encoded.indices,
    )


def from_proto(message: stage_pb2.Tensor, *, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Validate and decode any message (plain or compressed); raises codec.TensorValidationError."""
    shape = list(message.shape)
    if not message.encoding:
        if message.scales or message.indices or message.block_size:
            raise codec.TensorValidationError("a tensor without an encoding carries no scales, indices or block_size")
        return codec.decode(message.dtype, shape, message.data, max_bytes=max_bytes)
    if message.dtype != "float32":
        raise codec.TensorValidationError(
            f"only float32 tensors travel compressed, got dtype {message.dtype!r} with encoding {message.encoding!r}"
        )
    return compression.decode(
        message.encoding,
        shape,
        message.data,
        scales=message.scales,
        indices=message.indices,
        block_size=message.block_size,
        max_bytes=max_bytes,
    )


def payload_bytes(message: stage_pb2.Tensor) -> int:
    """Tensor bytes on the wire: what per-stage byte counters count."""
    return len(message.data) + len(message.scales) + len(message.indices)
