from __future__ import annotations

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.contracts.transfer import TransferConfig
from arceus.v1 import stage_pb2
from arceus.wire.incoming_push import IncomingPush, MalformedPush, parse_push
from arceus.wire.proto_tensor import decode_tensor
from arceus.wire.push_stream import encode_varint, outgoing_push, serialize
from arceus.wire.transfer import TransferEncoder

Request = stage_pb2.PushTensorRequest


def reference(wire: bytes) -> Request | None:
    try:
        return Request.FromString(wire)
    except DecodeError:
        return None


def reassembled(push: IncomingPush | MalformedPush) -> Request | None:
    """The full request `parse_push` read: its header with the payloads put back."""
    if isinstance(push, MalformedPush):
        return None
    request = Request()
    request.CopyFrom(push.header)
    if push.header.HasField("tensor"):
        request.tensor.data, request.tensor.scales, request.tensor.indices = (
            bytes(push.data), bytes(push.scales), bytes(push.indices)
        )
    else:
        assert push.nbytes == 0
    return request


def assert_parses_as_protobuf(wire: bytes) -> None:
    expected, got = reference(wire), reassembled(parse_push(wire))
    assert_same(expected, got)


def assert_same(expected: Request | None,
                got: Request | None) -> None:
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert got == expected and got.HasField("tensor") == expected.HasField("tensor")
    assert got.SerializeToString() == expected.SerializeToString()  # unknown fields too, in order


def record(field: int, wire_type: int, value: bytes | int) -> bytes:
    tag = encode_varint(field << 3 | wire_type)
    if wire_type == 0:
        return tag + encode_varint(int(value))
    assert isinstance(value, bytes)
    return tag + (encode_varint(len(value)) + value if wire_type == 2 else value)


blobs = st.binary(max_size=40)
unknown_records = st.one_of(
    st.builds(record, st.integers(8, 40), st.just(0), st.integers(0, 2**64 - 1)),
    st.builds(record, st.integers(8, 40), st.just(2), blobs),
    st.builds(record, st.integers(8, 40), st.just(1), st.binary(min_size=8, max_size=8)),
    st.builds(record, st.integers(8, 40), st.just(5), st.binary(min_size=4, max_size=4)),
)
tensor_records = st.one_of(
    st.builds(lambda s: record(1, 2, s.encode()), st.sampled_from(["float32", "int64", "", "é"])),
    st.builds(lambda d: record(2, 0, d), st.integers(0, 2**63 - 1)),
    st.builds(lambda ds: record(2, 2, b"".join(encode_varint(d) for d in ds)), st.lists(st.integers(0, 99))),
    st.builds(lambda b: record(3, 2, b), blobs),
    st.builds(lambda s: record(4, 2, s.encode()), st.sampled_from(["", "int8", "topk"])),
    st.builds(lambda b: record(5, 2, b), blobs),
    st.builds(lambda n: record(6, 0, n), st.integers(0, 2**32 - 1)),
    st.builds(lambda b: record(7, 2, b), blobs),
    st.builds(lambda n: record(3, 0, n), st.integers(0, 9)),  # data with the wrong wire type: unknown
    unknown_records,
)
request_records = st.one_of(
    st.builds(lambda rs: record(5, 2, b"".join(rs)), st.lists(tensor_records, max_size=8)),
    st.builds(lambda n: record(2, 0, n), st.integers(0, 3)),
    st.builds(lambda n: record(3, 0, n), st.integers(0, 2**64 - 1)),
    st.builds(lambda n: record(4, 0, n), st.integers(0, 2**32 - 1)),
    st.builds(
        lambda job, stage: record(1, 2, record(1, 2, job.encode()) + record(2, 0, stage)),
        st.text(max_size=5), st.integers(0, 5),
    ),
    unknown_records,
)
messages = st.lists(request_records, max_size=8).map(b"".join)
@settings(max_examples=400, deadline=None)
@given(wire=messages)
def test_any_encoding_parses_as_protobuf_parses_it(wire: bytes) -> None:
    """Fields in any order, repeated tensor records merged, unknown fields kept."""
    assert_parses_as_protobuf(wire)


@settings(max_examples=400, deadline=None)
@given(wire=messages, cut=st.integers(0, 10**6), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255))))
def test_damaged_bytes_are_rejected_or_parsed_as_protobuf_does(
    wire: bytes, cut: int, flips: list[tuple[int, int]]
) -> None:
    damaged = bytearray(wire[: cut % (len(wire) + 1)])
    for at, byte in flips:
        if damaged:
            damaged[at % len(damaged)] = byte
    assert_parses_as_protobuf(bytes(damaged))


@settings(max_examples=300, deadline=None)
@given(wire=st.binary(max_size=200))
def test_arbitrary_bytes_are_rejected_or_parsed_as_protobuf_does(wire: bytes) -> None:
    assert_parses_as_protobuf(wire)


@pytest.mark.parametrize(
    "wire",
    [
        record(5, 2, record(3, 2, b"abcd")) + bytes([0x83, 0x01, 0x84, 0x01]),  # an empty group (field 16)
        record(5, 2, bytes([0x9A, 0x00, 0x01, 0x41])),  # data under a two-byte tag
        b"".join(record(3, 0, i) for i in range(100)) + record(5, 2, record(3, 2, b"xy")),  # many records
    ],
)
def test_what_the_walk_leaves_to_protobuf_still_parses(wire: bytes) -> None:
    assert reference(wire) is not None
    assert_parses_as_protobuf(wire)


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        (record(5, 2, record(3, 2, b"abcd"))[:-1], "truncated"),
        (record(1, 2, b"\xff\xfe"), "a StageRef that is not one"),
        (record(5, 2, record(1, 2, b"\xff")), "dtype that is not UTF-8"),
        (bytes([0x2A, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F]), "a length past the end"),
        (b"\x00\x00", "field number 0"),
    ],
)
def test_malformed_bytes_say_so(wire: bytes, why: str) -> None:
    parsed = parse_push(wire)
    assert isinstance(parsed, MalformedPush), why
    assert "not a PushTensorRequest" in parsed.reason


@pytest.mark.parametrize("encoding", ["fp32", "int8"])
def test_our_pushes_decode_from_views_of_the_received_bytes(encoding: str) -> None:
    x = torch.randn(16, 300)
    encoded = TransferEncoder(TransferConfig(activations=encoding)).encode(x, gradient=False, stream=0)
    ref = stage_pb2.StageRef(job_id="job", stage_index=1, generation=2)
    wire = serialize(outgoing_push(ref, stage_pb2.ACTIVATION, 3, 1, encoded))
    push = parse_push(wire)
    assert isinstance(push, IncomingPush)
    assert push.header.target == ref and push.header.step == 3 and push.header.micro_batch == 1
    assert push.data.obj is wire and push.nbytes == encoded.nbytes  # a view, not a copy
    tensor = decode_tensor(push.header.tensor, push.data, push.scales, push.indices, copy=False)
    expected = x if encoding == "fp32" else decode_tensor(push.header.tensor, encoded.data, encoded.scales, b"")
    assert torch.equal(tensor, expected)
