"""Parse a received tensor push (a stage's PushTensorRequest) keeping its tensor payloads as views of the received
bytes.

gRPC hands a server each message as one `bytes`. `PushTensorRequest.FromString` would copy the tensor's
`data` out of it, and reading `request.tensor.data` copies it again. `parse_push` walks the
protobuf wire format instead: the Tensor's payload fields (data, scales, indices) stay memoryview slices of the received
bytes, so decoding float32 is a `torch.frombuffer` of them, and every other record goes to protobuf, which
parses and validates it as usual.

The result is what `FromString` gives for any input: records merge as protobuf merges them (of repeated
`tensor` records, the last `data` wins), unknown fields are kept. The walk takes the records senders emit:
one-byte tags (fields 1 to 15) of wire types varint, fixed64, length-delimited or fixed32, a bounded
number of them. Any other input (groups, longer tags, broken framing, a flood of records) goes to
`FromString` whole, which rejects it or parses it (with its copies).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError

from arceus.v1 import stage_pb2
from arceus.wire.push_stream import encode_varint

Request = TypeVar("Request", bound=stage_pb2.PushTensorRequest)
_PUSH_TENSOR = 0x2A  # PushTensorRequest.tensor: field 5, length-delimited
_DATA, _SCALES, _INDICES = 0x1A, 0x2A, 0x3A  # Tensor.data, .scales, .indices: fields 3, 5, 7, length-delimited
_MAX_RECORDS = 64  # per message level; a real push has about ten
_MAX_LENGTH = 0x7FFFFFFF  # protobuf's bound on a length-delimited field


@dataclass(frozen=True)
class IncomingPush(Generic[Request]):
    """A received request: `header` is all of it but the tensor's payloads, which are read-only views."""

    header: Request
    data: memoryview
    scales: memoryview
    indices: memoryview

    @property
    def nbytes(self) -> int:
        """Tensor bytes on the wire: what per-stage byte counters count."""
        return len(self.data) + len(self.scales) + len(self.indices)


@dataclass(frozen=True)
class MalformedPush:
    """Received bytes that are not the request they were sent as."""

    reason: str


class _Unwalkable(Exception):
    """Input outside what the walk takes; protobuf parses it whole."""


def parse_push(wire: bytes) -> IncomingPush[stage_pb2.PushTensorRequest] | MalformedPush:
    """A gRPC request deserializer of PushTensorRequest: never raises, so the servicer answers bad bytes itself."""
    return _parse(wire, stage_pb2.PushTensorRequest, _PUSH_TENSOR)


def _parse(wire: bytes, message: type[Request], tensor_tag: int) -> IncomingPush[Request] | MalformedPush:
    view = memoryview(wire)
    try:
        header, payloads = _split(wire, tensor_tag)
    except _Unwalkable:
        return _parse_whole(wire, message)
    try:
        request = message.FromString(header)
    except DecodeError as exc:
        return MalformedPush(f"the message is not a {message.__name__}: {exc}")
    data, scales, indices = (view[start:end] for start, end in payloads)
    return IncomingPush(request, data, scales, indices)


def _parse_whole(wire: bytes, message: type[Request]) -> IncomingPush[Request] | MalformedPush:
    try:
        request = message.FromString(wire)
    except DecodeError as exc:
        return MalformedPush(f"the message is not a {message.__name__}: {exc}")
    if not request.HasField("tensor"):
        return IncomingPush(request, memoryview(b""), memoryview(b""), memoryview(b""))
    tensor = request.tensor
    data, scales, indices = (memoryview(p) for p in (tensor.data, tensor.scales, tensor.indices))
    for field in ("data", "scales", "indices"):
        tensor.ClearField(field)
    return IncomingPush(request, data, scales, indices)


def _split(wire: bytes, tensor_tag: int) -> tuple[bytes, list[tuple[int, int]]]:
    """The message without the tensor payload records (the tensor's record tagged `tensor_tag`), and each
    payload's (start, end) in `wire`."""
    payloads = {_DATA: (0, 0), _SCALES: (0, 0), _INDICES: (0, 0)}
    pieces: list[bytes] = []
    for tag, start, value, end in _records(wire, 0, len(wire)):
        if tag != tensor_tag:
            pieces.append(wire[start:end])
            continue
        fields: list[bytes] = []
        for inner_tag, inner_start, inner_value, inner_end in _records(wire, value, end):
            if inner_tag in payloads:
                payloads[inner_tag] = (inner_value, inner_end)  # the last one wins, as protobuf merges
            else:
                fields.append(wire[inner_start:inner_end])
        tensor = b"".join(fields)
        pieces += (bytes((tensor_tag,)), encode_varint(len(tensor)), tensor)
    return b"".join(pieces), [payloads[_DATA], payloads[_SCALES], payloads[_INDICES]]


def _records(wire: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(tag, record start, value start, record end) of each record in wire[pos:end]."""
    count = 0
    while pos < end:
        count += 1
        tag = wire[pos]
        if count > _MAX_RECORDS or tag >= 0x80 or tag < 0x08:  # a longer tag, or field number 0
            raise _Unwalkable
        start, value, wire_type = pos, pos + 1, tag & 7
        if wire_type == 0:
            _, stop = _varint(wire, value, end)
        elif wire_type == 1:
            stop = value + 8
        elif wire_type == 2:
            length, value = _varint(wire, value, end)
            if length >= _MAX_LENGTH:
                raise _Unwalkable
            stop = value + length
        elif wire_type == 5:
            stop = value + 4
        else:
            raise _Unwalkable
        if stop > end:
            raise _Unwalkable
        yield tag, start, value, stop
        pos = stop


def _varint(wire: bytes, pos: int, end: int) -> tuple[int, int]:
    """A varint's value and the position after it (at most 10 bytes, as protobuf reads them)."""
    value = shift = 0
    for index in range(pos, min(pos + 10, end)):
        byte = wire[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index + 1
        shift += 7
    raise _Unwalkable
