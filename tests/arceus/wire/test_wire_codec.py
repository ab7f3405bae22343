from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.v1 import stage_pb2
from arceus.wire import codec
from arceus.wire.proto_tensor import from_proto, to_proto

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(TORCH_DTYPES)),
    shape=st.lists(st.integers(0, 5), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_exact(dtype: str, shape: list[int], seed: int) -> None:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    tensor = values.to(TORCH_DTYPES[dtype])
    name, wire_shape, data = codec.encode(tensor)
    assert (name, wire_shape, len(data)) == (dtype, shape, tensor.numel() * tensor.element_size())
    decoded = codec.decode(name, wire_shape, data)
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_bytes_are_little_endian_c_order() -> None:
    tensor = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t()  # non-contiguous: encoded in its logical order
    _, shape, data = codec.encode(tensor)
    assert shape == [2, 2]
    assert data == struct.pack("<4f", 1.0, 3.0, 2.0, 4.0)
    assert codec.encode(torch.tensor([1], dtype=torch.int64))[2] == b"\x01" + b"\x00" * 7


def test_bfloat16_keeps_its_bits() -> None:
    tensor = torch.tensor([1.0, -2.5, 3.140625, float("inf")], dtype=torch.bfloat16)
    name, shape, data = codec.encode(tensor)
    assert name == "bfloat16" and len(data) == 8
    assert data[:2] == struct.pack("<H", 0x3F80)  # 1.0 in bfloat16
    assert torch.equal(codec.decode(name, shape, data), tensor)


def test_decoded_tensor_owns_writable_memory() -> None:
    data = bytes(codec.encode(torch.ones(3))[2])
    decoded = codec.decode("float32", [3], data)
    decoded += 1  # would fail or corrupt the message if it aliased the read-only buffer
    assert torch.equal(decoded, torch.full((3,), 2.0))


@pytest.mark.parametrize(
    ("dtype", "shape", "data", "fragment"),
    [
        ("float64", [1], b"\0" * 8, "unsupported tensor dtype 'float64'"),
        ("pickle", [1], b"\x80\x04", "unsupported tensor dtype"),
        ("float32", [2, -1], b"", "negative dimension"),
        ("float32", [1] * 9, b"\0" * 4, "rank 9 is above the limit"),
        ("float32", [3], b"\0" * 8, "needs exactly 12 bytes, got 8"),
        ("float32", [1], b"\0" * 8, "needs exactly 4 bytes, got 8"),
        ("float32", [1 << 20, 1 << 20], b"", "above the limit"),
    ],
)
def test_invalid_payloads_are_rejected(dtype: str, shape: list[int], data: bytes, fragment: str) -> None:
    with pytest.raises(codec.TensorValidationError, match=None) as info:
        codec.decode(dtype, shape, data)
    assert fragment in str(info.value)


def test_byte_limit_applies_to_the_payload_itself() -> None:
    with pytest.raises(codec.TensorValidationError, match="payload is 400 bytes, above the limit of 100"):
        codec.decode("float32", [100], b"\0" * 400, max_bytes=100)


def test_unsendable_dtype() -> None:
    with pytest.raises(codec.TensorValidationError, match="cannot be sent"):
        codec.encode(torch.zeros(2, dtype=torch.complex64))


def test_proto_helpers_round_trip() -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    message = to_proto(tensor)
    parsed = stage_pb2.Tensor.FromString(message.SerializeToString())
    assert torch.equal(from_proto(parsed), tensor)
    with pytest.raises(codec.TensorValidationError):
        from_proto(stage_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"\0" * 23))
