"""`PushStream`: one long-lived `StageService.PushStream` call from a sender to a stage's agent.

The call is opened on the first push and reopened after it breaks (or nears its own deadline). The
agent acks every request in order, so acks are matched to pushes first in, first out; each push
completes by its own deadline: a stream whose oldest unacked push is overdue is cancelled and all its
pushes fail with DEADLINE_EXCEEDED. A refused message fails only its own push.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import grpc

from arceus.v1 import stage_pb2
from arceus.wire.codec import Payload
from arceus.wire.compression import Encoded
from arceus.wire.proto_tensor import write_encoded_header

log = logging.getLogger(__name__)
METHOD = "/arceus.v1.StageService/PushStream"
# The call's own deadline. A push whose timeout would outlive the open call goes to a fresh one.
STREAM_SECONDS = 3600.0
# How often an idle call's watchdog looks at its pushes. It sleeps until the earliest deadline it knows of, and a push
# wakes it only if due before it looks next: a wake-up per push (a thread switch and the GIL) was a good part of each
# micro-batch's hop (docs/BENCHMARKS.md, pipeline_vs_single).
IDLE_WATCH_SECONDS = 1.0
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class PushError(grpc.RpcError):
    """A push that failed: refused by the receiver (its ack's code) or lost with its stream."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass(frozen=True)
class OutgoingPush:
    """A PushTensorRequest whose `tensor.data` travels apart, so serializing it copies the payload
    once (into the wire bytes) instead of into the message and then out of it again."""

    header: stage_pb2.PushTensorRequest  # everything but tensor.data
    data: Payload

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.header.kind, self.header.step, self.header.micro_batch)


def outgoing_push(
    target: stage_pb2.StageRef, kind: int, step: int, micro_batch: int, encoded: Encoded, *, epoch: int = 0,
    ack_later: bool = False,
) -> OutgoingPush:
    """`epoch`: a replica's membership epoch (PushTensorRequest.epoch; 0 for a stage that is not replicated).
    `ack_later`: a push whose ack may come with a later push's (PushTensorRequest.ack_later): the sender promises
    another push on the same stream, which it will wait for."""
    header = stage_pb2.PushTensorRequest(
        target=target, kind=kind, step=step, micro_batch=micro_batch, epoch=epoch, ack_later=ack_later
    )
    write_encoded_header(header.tensor, encoded)
    return OutgoingPush(header, encoded.data)


def raw_push(
    target: stage_pb2.StageRef, kind: int, step: int, micro_batch: int, dtype: str, shape: list[int], data: Payload
) -> OutgoingPush:
    header = stage_pb2.PushTensorRequest(target=target, kind=kind, step=step, micro_batch=micro_batch)
    header.tensor.dtype = dtype
    header.tensor.shape[:] = shape
    return OutgoingPush(header, data)


def serialize(push: OutgoingPush) -> bytes:
    """Protobuf wire bytes of the full request: the header, then a second `tensor` (field 5) record
    holding only `data` (field 3); protobuf merges repeated message records, so parsers see one."""
    n = memoryview(push.data).nbytes
    data_field = b"\x1a" + encode_varint(n)
    return b"".join(
        (push.header.SerializeToString(), b"\x2a", encode_varint(len(data_field) + n), data_field, push.data)
    )


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@dataclass
class _Pending:
    key: tuple[int, int, int]
    future: Future[None]
    deadline: float
    ack_later: bool


class _Call:
    """One open PushStream call: a request queue, a thread reading acks, one watching deadlines."""

    def __init__(
        self, method: grpc.StreamStreamMultiCallable, lifetime: float, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        self._requests: queue.SimpleQueue[OutgoingPush | None] = queue.SimpleQueue()
        self._pending: deque[_Pending] = deque()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the watchdog waits on it
        # The ack reader waits on this one (the same lock) while no ack is due: gRPC's response iterator looks for a
        # message every 0.1 s while it waits (grpc._common.wait), so a reader left in it wakes ten times a second on
        # every idle stream (docs/BENCHMARKS.md, swarm_scaling).
        self._acks_due = threading.Condition(lock)
        self._ended = False  # the call ended (gRPC's done callback): the reader reads how
        self._ends = time.monotonic() + lifetime
        self._closing = False
        self.broken = False
        self._watch_at = 0.0  # when the watchdog looks next (time.monotonic())
        self._responses = method(self._request_iterator(), timeout=lifetime, metadata=metadata)
        self._responses.add_done_callback(self._call_ended)
        for target, name in ((self._read, "push-acks"), (self._watch, "push-deadlines")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def usable(self, timeout: float) -> bool:
        with self._cond:
            return not (self.broken or self._closing) and time.monotonic() + timeout < self._ends

    def send(self, push: OutgoingPush, future: Future[None], timeout: float) -> bool:
        """Queue `push`; False if this call broke meanwhile (nothing was sent)."""
        with self._cond:
            if self.broken or self._closing:
                return False
            deadline = time.monotonic() + timeout
            if deadline < self._watch_at:  # woken only when it would look too late: not once a push
                self._cond.notify_all()
            self._pending.append(_Pending(push.key, future, deadline, push.header.ack_later))
            self._acks_due.notify()
        self._requests.put(push)
        return True

    def finish(self) -> None:
        """Half-close: acks of what was sent still arrive, then the call ends."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._acks_due.notify()
        self._requests.put(None)

    def cancel(self, details: str) -> None:
        self._break(grpc.StatusCode.CANCELLED, details)

    def _request_iterator(self) -> Iterator[OutgoingPush]:
        while (push := self._requests.get()) is not None:
            yield push

    def _call_ended(self, _: object) -> None:
        with self._cond:
            self._ended = True
            self._acks_due.notify()

    def _acks(self) -> Iterator[stage_pb2.PushAck]:
        """The call's acks, read only while one is due (a push sent and not acked, or the call closing or ended)."""
        while True:
            with self._cond:
                while not (self._pending or self._closing or self._ended or self.broken):
                    self._acks_due.wait()
                if self.broken:
                    return
            ack = next(self._responses, None)
            if ack is None:
                return
            yield ack

    def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the receiver ended the push stream"
        try:
            for ack in self._acks():
                with self._cond:  # the watchdog finds out at its next wake-up
                    answered = [self._pending.popleft() for _ in range(min(ack.also_acked, len(self._pending)))]
                    pending = self._pending.popleft() if self._pending else None
                if len(answered) != ack.also_acked or not all(p.ack_later for p in answered):
                    code, details = grpc.StatusCode.INTERNAL, f"the receiver acked pushes it was not sent: {ack}"
                    for p in (*answered, *([pending] if pending else [])):
                        _settle(p.future, PushError(code, details))
                    break
                for p in answered:
                    _settle(p.future, None)
                if pending is None or pending.key != (ack.kind, ack.step, ack.micro_batch):
                    code, details = grpc.StatusCode.INTERNAL, f"the receiver acked an unexpected push {ack}"
                    if pending is not None:
                        _settle(pending.future, PushError(code, details))
                    break
                if ack.code == 0:
                    _settle(pending.future, None)
                else:
                    _settle(pending.future, PushError(_CODES.get(ack.code, grpc.StatusCode.UNKNOWN), ack.message))
                # Not kept while the next ack is awaited: a settled future keeps its callbacks, and through them what
                # the sender keeps of its step (a replica's HeldStep, with a whole partial gradient).
                pending = answered = None
            else:
                with self._cond:
                    if self._closing and not self._pending:
                        self.broken = True  # ended as asked: nothing to fail
                        self._cond.notify_all()
                        return
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        self._break(code, details)

    def _watch(self) -> None:
        with self._cond:
            while not self.broken:
                now = time.monotonic()
                if not self._pending:
                    if self._closing:
                        return
                    self._watch_at = now + IDLE_WATCH_SECONDS
                    self._cond.wait(IDLE_WATCH_SECONDS)
                    continue
                # A cancelled push left for a later ack waits in line for that ack, past its deadline: not overdue.
                due = [p.deadline for p in self._pending if not p.future.done()]
                if not due:
                    self._watch_at = now + IDLE_WATCH_SECONDS
                    self._cond.wait(IDLE_WATCH_SECONDS)
                    continue
                overdue = min(due) - now
                if overdue <= 0:
                    break
                self._watch_at = now + overdue
                self._cond.wait(overdue)
            else:
                return
        self._break(grpc.StatusCode.DEADLINE_EXCEEDED, "the receiver did not ack a push within its deadline")

    def _break(self, code: grpc.StatusCode, details: str) -> None:
        with self._cond:
            if self.broken:
                return
            self.broken = True
            failed = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
            self._acks_due.notify()
        self._responses.cancel()
        self._requests.put(None)  # ends the request iterator
        for pending in failed:
            _settle(pending.future, PushError(code, details))
        if failed:
            log.info("push stream broke with %s (%s); %d pushes failed", code.name, details, len(failed))


def _settle(future: Future[None], error: BaseException | None) -> None:
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass  # the sender cancelled it


class PushStream:
    """Pushes to one agent over one channel; thread-safe."""

    def __init__(
        self, channel: grpc.Channel, *, lifetime: float = STREAM_SECONDS, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """`metadata`: sent with every call beside the channel's own (a replica's token: nodeagent.stage)."""
        self._metadata = metadata
        self._method = channel.stream_stream(
            METHOD, request_serializer=serialize, response_deserializer=stage_pb2.PushAck.FromString
        )
        self._lifetime = lifetime
        self._lock = threading.Lock()
        self._call: _Call | None = None
        self._closed = False

    def push(self, push: OutgoingPush, timeout: float) -> Future[None]:
        """Send `push`; the future resolves on its ack, or fails with PushError by `timeout` seconds."""
        future: Future[None] = Future()
        with self._lock:
            if self._closed:
                _settle(future, PushError(grpc.StatusCode.CANCELLED, "the push stream was closed"))
                return future
            for _ in range(2):  # a call that broke between the check and the send is replaced once
                if self._call is None or not self._call.usable(timeout):
                    if self._call is not None:
                        self._call.finish()
                    self._call = _Call(self._method, self._lifetime, self._metadata)
                if self._call.send(push, future, timeout):
                    return future
        _settle(future, PushError(grpc.StatusCode.UNAVAILABLE, "the push stream broke while sending"))
        return future

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._call is not None:
                self._call.cancel("the push stream was closed")
                self._call = None
