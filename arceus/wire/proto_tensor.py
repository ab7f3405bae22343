"""Thin conversions between torch tensors and the `arceus.v1.Tensor` message."""

from __future__ import annotations

import torch

from arceus.v1 import stage_pb2
from arceus.wire import codec


def to_proto(tensor: torch.Tensor) -> stage_pb2.Tensor:
    dtype, shape, data = codec.encode(tensor)
    return stage_pb2.Tensor(dtype=dtype, shape=shape, data=data)


def from_proto(message: stage_pb2.Tensor, *, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> torch.Tensor:
    return codec.decode(message.dtype, list(message.shape), message.data, max_bytes=max_bytes)

