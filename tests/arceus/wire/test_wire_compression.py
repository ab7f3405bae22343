from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.wire import codec, compression
from arceus.wire.codec import TensorValidationError
from arceus.wire.compression import ErrorFeedback, decode, decode_payload, encode

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4)
seeds = st.integers(0, 2**16)


def sample(shape: list[int], seed: int, scale: float = 10.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@settings(max_examples=80, deadline=None)
@given(shape=shapes, seed=seeds, block_size=st.integers(8, 200), scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_int8_error_is_within_half_a_step_of_each_block(
    shape: list[int], seed: int, block_size: int, scale: float
) -> None:
    x = sample(shape, seed, scale)
    encoded = encode(x, "int8", block_size=block_size)
    y = decode_payload(encoded)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert len(encoded.data) == x.numel() and len(encoded.scales) == 4 * math.ceil(x.numel() / block_size)
    flat, err = x.reshape(-1), (x - y).abs().reshape(-1)
    for start in range(0, flat.numel(), block_size):  # the test may loop; the code may not
        absmax = float(flat[start : start + block_size].abs().max())
        assert float(err[start : start + block_size].max()) <= absmax / 254 * (1 + 1e-5) + 1e-30


def block_codes(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The int8 codes, block by block: round half to even of x * (127 / absmax), 0 in an all-zero block."""
    flat = x.reshape(-1)
    blocks = [flat[i : i + block_size] for i in range(0, flat.numel(), block_size)]  # the test may loop
    codes = [(b * (127.0 / b.abs().max())).round() if b.abs().max() > 0 else torch.zeros_like(b) for b in blocks]
    return torch.cat(codes).to(torch.int8) if codes else torch.zeros(0, dtype=torch.int8)


def codes_of(encoded: compression.Encoded) -> torch.Tensor:
    return torch.tensor(list(struct.unpack(f"{len(encoded.data)}b", encoded.data)), dtype=torch.int8)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=seeds, block_size=st.integers(8, 40))
def test_int8_codes_are_each_blocks_rounded_scaled_values(shape: list[int], seed: int, block_size: int) -> None:
    x = sample(shape, seed)
    assert torch.equal(codes_of(encode(x, "int8", block_size=block_size)), block_codes(x, block_size))


@pytest.mark.parametrize("block_size", [64, 200])
def test_int8_codes_of_a_tensor_larger_than_one_encoding_pass(block_size: int) -> None:
    x = sample([3 * 2**19 + 77], 1)  # several passes of the encoder, then a partial block
    encoded = encode(x, "int8", block_size=block_size)
    codes = torch.frombuffer(bytearray(encoded.data), dtype=torch.int8)
    assert torch.equal(codes, block_codes(x, block_size))


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=seeds, encoding=st.sampled_from(["fp16", "bf16"]))
def test_half_precision_keeps_shape_and_relative_precision(shape: list[int], seed: int, encoding: str) -> None:
    x = sample(shape, seed)
    encoded = encode(x, encoding)
    y = decode_payload(encoded)
    assert y.dtype == torch.float32 and y.shape == x.shape and len(encoded.data) == 2 * x.numel()
    rel = 2**-11 if encoding == "fp16" else 2**-8
    assert torch.all((x - y).abs() <= x.abs() * rel + 1e-6)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=seeds)
def test_fp32_is_the_plain_codec_bytes(shape: list[int], seed: int) -> None:
    x = sample(shape, seed)
    encoded = encode(x, "fp32")
    assert encoded.data == codec.encode(x)[2] and encoded.nbytes == 4 * x.numel()
    assert torch.equal(decode_payload(encoded), x)


def test_fp32_data_is_a_view_of_the_tensor_not_a_copy() -> None:
    x = torch.zeros(3, 4)
    encoded = encode(x, "fp32")
    x[1, 2] = 5.0  # what a caller must not do before the payload is serialized
    assert struct.unpack_from("<f", encoded.data, 4 * 6) == (5.0,)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=seeds, ratio=st.floats(0.01, 1.0))
def test_topk_keeps_the_largest_values_exactly(shape: list[int], seed: int, ratio: float) -> None:
    x = sample(shape, seed)
    encoded = encode(x, "topk", topk_ratio=ratio)
    y = decode_payload(encoded).reshape(-1)
    k = compression.topk_count(x.numel(), ratio) if x.numel() else 0
    assert decode_payload(encoded).shape == x.shape and encoded.nbytes == 8 * k
    kept = y != 0
    assert torch.equal(y[kept], x.reshape(-1)[kept])
    if k and k < x.numel():  # nothing dropped is larger than anything kept
        assert x.reshape(-1)[~kept].abs().max() <= x.reshape(-1)[kept].abs().min()


@pytest.mark.parametrize("block_size", [64, 128, 256])
def test_int8_is_at_least_3_5_times_smaller_than_fp32(block_size: int) -> None:
    x = sample([32, 1000], 0)
    assert x.numel() * 4 / encode(x, "int8", block_size=block_size).nbytes >= 3.5


def test_zero_and_partial_blocks_are_safe() -> None:
    x = torch.cat([torch.zeros(64), torch.tensor([0.5, -3.0, 1.0])])  # one zero block, one partial block
    y = decode_payload(encode(x, "int8", block_size=64))
    assert torch.equal(y[:64], torch.zeros(64)) and not torch.isnan(y).any()
    assert torch.allclose(y[64:], x[64:], atol=3.0 / 254)
    assert y[65] == -3.0  # the absmax of a block is exact


@pytest.mark.parametrize("block_size", [0, 7, True, 2.0, 1 << 21])
def test_bad_block_sizes_are_refused(block_size: object) -> None:
    with pytest.raises(TensorValidationError, match="block_size"):
        encode(torch.ones(10), "int8", block_size=block_size)  # type: ignore[arg-type]


def test_only_finite_float32_is_compressed() -> None:
    with pytest.raises(TensorValidationError, match="float32"):
        encode(torch.ones(3, dtype=torch.float64), "int8")
    with pytest.raises(TensorValidationError, match="finite"):
        encode(torch.tensor([1.0, float("nan")]), "int8")
    with pytest.raises(TensorValidationError, match="unknown encoding"):
        encode(torch.ones(3), "int4")


def test_error_feedback_conserves_the_sum_over_steps() -> None:
    feedback = ErrorFeedback()
    sent = torch.zeros(40, 50)
    total = torch.zeros(40, 50)
    for step in range(25):
        g = sample([40, 50], step)
        total += g
        sent += decode_payload(feedback.encode(g, "topk", topk_ratio=0.05))
    assert feedback.residual is not None
    torch.testing.assert_close(sent + feedback.residual, total, rtol=0, atol=1e-4)
    # and the residual stays bounded instead of growing with the steps
    assert feedback.residual.abs().max() < 25 * total.abs().max() / 5


def test_error_feedback_drops_a_residual_of_another_shape() -> None:
    feedback = ErrorFeedback()
    feedback.encode(torch.ones(4, 10), "topk", topk_ratio=0.1)
    y = decode_payload(feedback.encode(torch.ones(2, 10), "topk", topk_ratio=1.0))
    assert torch.equal(y, torch.ones(2, 10))


def int8_payload(n: int = 10, block_size: int = 8) -> dict[str, object]:
    e = encode(torch.arange(n, dtype=torch.float32), "int8", block_size=block_size)
    return {"data": e.data, "scales": e.scales, "block_size": e.block_size}


@pytest.mark.parametrize(
    ("encoding", "shape", "fields", "match"),
    [
        ("int8", [10], {**int8_payload(), "data": b"\x00" * 9}, "int8 data"),
        ("int8", [10], {**int8_payload(), "scales": b"\x00" * 4}, "int8 scales"),
        ("int8", [10], {**int8_payload(), "block_size": 0}, "block_size"),
        ("int8", [10], {**int8_payload(), "scales": struct.pack("<2f", 1.0, float("nan"))}, "finite"),
        ("int8", [10], {**int8_payload(), "scales": struct.pack("<2f", 1.0, -1.0)}, ">= 0"),
        ("fp16", [3], {"data": b"\x00" * 5}, "fp16 data"),
        ("fp16", [3], {"data": b"\x00" * 6, "scales": b"\x00" * 4}, "no scales"),
        ("topk", [4], {"data": b"\x00" * 4, "indices": struct.pack("<i", 4)}, "strictly increasing"),
        ("topk", [4], {"data": b"\x00" * 8, "indices": struct.pack("<2i", 2, 2)}, "strictly increasing"),
        ("topk", [4], {"data": b"\x00" * 4, "indices": struct.pack("<i", -1)}, "strictly increasing"),
        ("topk", [4], {"data": b"\x00" * 8, "indices": struct.pack("<i", 1)}, "topk values"),
        ("topk", [2], {"data": b"\x00" * 12, "indices": struct.pack("<3i", 0, 1, 2)}, "3 values"),
        ("topk", [4], {"data": b"", "indices": b"\x00" * 3}, "whole int32"),
        ("int4", [4], {"data": b"\x00" * 4}, "unknown encoding"),
        ("fp32", [-1, 4], {"data": b""}, "negative"),
        ("fp32", [2**30, 2**30], {"data": b""}, "above the limit"),
    ],
)
def test_malformed_payloads_are_rejected_before_torch(
    encoding: str, shape: list[int], fields: dict[str, object], match: str
) -> None:
    with pytest.raises(TensorValidationError, match=match):
        decode(encoding, shape, **fields)  # type: ignore[arg-type]


def test_decoded_tensor_owns_writable_memory() -> None:
    for encoding in compression.ENCODINGS:
        y = decode_payload(encode(torch.ones(70), encoding, topk_ratio=1.0))
        y += 1  # would fail on a read-only message buffer
        assert torch.equal(y, torch.full((70,), 2.0))
