"""Thin conversions between torch tensors and the `arceus.v1.Tensor` message."""

from __future__ import annotations

import torch

from arceus.v1 import stage_pb2
from arceus.wire import codec, compression


def to_proto(tensor: torch.Tensor) -> stage_pb2.Tensor:
    dtype, shape, data = codec.encode(tensor)
    return stage_pb2.Tensor(dtype=dtype, shape=shape, data=data)


def encoded_to_proto(encoded: compression.Encoded) -> stage_pb2.Tensor:
    return write_encoded(stage_pb2.Tensor(), encoded)


def write_encoded(message: stage_pb2.Tensor, encoded: compression.Encoded) -> stage_pb2.Tensor:
    """Fill `message` in place, e.g. `request.tensor`: passing a built Tensor to the request's
    constructor merges it field by field, about 4.5 ms for 4 MB against 0.1 ms for setting it here.
    "fp32" leaves `encoding` unset, so it is byte for byte the plain message."""
    write_encoded_header(message, encoded)
    message.data = bytes(encoded.data)
    return message


def write_encoded_header(message: stage_pb2.Tensor, encoded: compression.Encoded) -> None:
    """Every field of `encoded` but `data` (which a push stream sends apart)."""
    message.dtype = "float32"
    message.shape[:] = encoded.shape
    if encoded.encoding != "fp32":
        message.encoding = encoded.encoding
        message.scales = bytes(encoded.scales)
        message.block_size = encoded.block_size
        message.indices = bytes(encoded.indices)


def from_proto(
    message: stage_pb2.Tensor, *, max_bytes: int = codec.DEFAULT_MAX_BYTES, copy: bool = True
) -> torch.Tensor:
    """Validate and decode any message (plain or compressed); raises codec.TensorValidationError.
    `copy=False`: a plain tensor may be a read-only view of the message's bytes (codec.decode)."""
    return decode_tensor(message, message.data, message.scales, message.indices, max_bytes=max_bytes, copy=copy)


def decode_tensor(
    header: stage_pb2.Tensor,
    data: codec.Payload,
    scales: codec.Payload,
    indices: codec.Payload,
    *,
    max_bytes: int = codec.DEFAULT_MAX_BYTES,
    copy: bool = True,
) -> torch.Tensor:
    """`from_proto` of a Tensor whose payloads come apart from its header (e.g. views of received bytes,
    see incoming_push); the header's own data, scales and indices are ignored."""
    shape = list(header.shape)
    if not header.encoding:
        if scales or indices or header.block_size:
            raise codec.TensorValidationError("a tensor without an encoding carries no scales, indices or block_size")
        return codec.decode(header.dtype, shape, data, max_bytes=max_bytes, copy=copy)
    if header.dtype != "float32":
        raise codec.TensorValidationError(
            f"only float32 tensors travel compressed, got dtype {header.dtype!r} with encoding {header.encoding!r}"
        )
    return compression.decode(
        header.encoding, shape, data, scales=scales, indices=indices, block_size=header.block_size,
        max_bytes=max_bytes,
    )

