"""nodeagent.peer_streams: the listener hands each pinned stream to the kind its hello's magic names (any other is
closed before anyone sees it), a frame's body goes where the frame says only once its header was accepted, and a
stream a peer opened waits in its owner's Offers until a step takes it (or the step's deadline, abort or owner
ends the wait)."""

from __future__ import annotations

import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest

from arceus.wire.tls import new_identity
from nodeagent.peer_streams import FrameStream, HelloKind, Offers, PeerStreams, StreamFailure, pump_all
from nodeagent.rpc import RpcFailure

LISTENER, DIALER = new_identity(), new_identity()
HEADER = struct.Struct("!4sI")  # a test frame: a tag and its body's length


class Frame:
    """A frame of `tag` whose body (at most `bound` bytes) is allocated once its header is accepted."""

    def __init__(self, tag: bytes, bound: int) -> None:
        self.tag, self.bound = tag, bound
        self.body: bytearray | None = None
        self.finished = False

    @property
    def what(self) -> str:
        return f"its {self.tag!r} frame"

    def accept(self, header: bytes, sender: str) -> Sequence[memoryview]:
        tag, length = HEADER.unpack(header)
        if tag != self.tag or length > self.bound:
            raise StreamFailure(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{sender} sent {tag!r} of {length} bytes where {self.what} was due")
        self.body = bytearray(length)
        return (memoryview(self.body),)

    def done(self) -> None:
        self.finished = True


@pytest.fixture
def listener() -> Iterator[tuple[PeerStreams, queue.Queue[tuple[bytes, ssl.SSLSocket]]]]:
    """A listener trusting DIALER, taking hellos of kinds b"AAA1" (8 bytes) and b"BBB1" (12 bytes)."""
    adopted: queue.Queue[tuple[bytes, ssl.SSLSocket]] = queue.Queue()
    streams = PeerStreams(LISTENER)
    streams.trust([DIALER.certificate])
    streams.listen("127.0.0.1", {magic: HelloKind(size, lambda data, sock: adopted.put((data, sock)))
                                 for magic, size in ((b"AAA1", 8), (b"BBB1", 12))})
    yield streams, adopted
    streams.close()


def dial(port: int, hello: bytes) -> ssl.SSLSocket:
    return PeerStreams(DIALER).dial("127.0.0.1:1", "", port, LISTENER.certificate, hello, time.monotonic() + 10,
                                    peer="the listener")


def test_the_listener_hands_each_hello_to_its_kind_and_closes_any_other(listener) -> None:
    streams, adopted = listener
    dial(streams.port, b"BBB1" + b"12345678")
    dial(streams.port, b"AAA1" + b"abcd")
    got = dict(adopted.get(timeout=10) for _ in range(2))
    assert set(got) == {b"BBB1" + b"12345678", b"AAA1" + b"abcd"}
    stranger = dial(streams.port, b"ZZZ1" + b"abcd")
    stranger.settimeout(10)
    assert stranger.recv(1) == b""  # closed: no kind of this listener's
    assert adopted.empty()
    with pytest.raises(ValueError):
        PeerStreams(LISTENER).listen("127.0.0.1", {b"TOOLONG": HelloKind(12, lambda data, sock: None)})


def test_a_frame_body_goes_where_its_accepted_header_says_and_a_refused_header_fails_before_its_body(
    listener,
) -> None:
    streams, adopted = listener
    sender = FrameStream(dial(streams.port, b"AAA1abcd"), HEADER.size, "the listener", "the dialer")
    receiver = FrameStream(adopted.get(timeout=10)[1], HEADER.size, "the dialer", "the listener")
    first, second = Frame(b"act0", 64), Frame(b"act1", 64)
    receiver.expect(first)
    receiver.expect(second)
    sender.send(HEADER.pack(b"act0", 5), b"hello")
    sender.send(HEADER.pack(b"act1", 0))  # an empty body is a frame too
    pump_all([sender, receiver], deadline=time.monotonic() + 10, abort=threading.Event(),
             done=lambda: sender.idle and receiver.idle, waiting_for=lambda: "the frames")
    assert first.finished and first.body == b"hello" and second.finished and second.body == b""
    # A header claiming more than the frame due allows: refused before its body is read, nothing allocated.
    too_big = Frame(b"act2", 64)
    receiver.expect(too_big)
    sender.send(HEADER.pack(b"act2", 2**31))
    with pytest.raises(StreamFailure) as info:
        pump_all([sender, receiver], deadline=time.monotonic() + 10, abort=threading.Event(),
                 done=lambda: receiver.idle, waiting_for=lambda: "the frame")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the listener: the dialer sent b'act2' of 2147483648 bytes where its b'act2' frame was due" \
        in info.value.message
    assert too_big.body is None
    # A refused stream is over (its owner closes it). On another, the sender closes: the frame it owed fails naming it.
    receiver.close()
    sender.close()
    sender = FrameStream(dial(streams.port, b"AAA1abcd"), HEADER.size, "the listener", "the dialer")
    receiver = FrameStream(adopted.get(timeout=10)[1], HEADER.size, "the dialer", "the listener")
    receiver.expect(Frame(b"act3", 64))
    sender.close()
    with pytest.raises(StreamFailure, match="the dialer closed its stream before its b'act3' frame"):
        pump_all([receiver], deadline=time.monotonic() + 10, abort=threading.Event(),
                 done=lambda: receiver.idle, waiting_for=lambda: "the frame")


def test_an_offer_is_taken_once_kept_a_newer_replacing_an_older_and_a_stale_one_closed_and_waited_past() -> None:
    offers: Offers[int, int] = Offers("stage 1 of job j")
    old, old_peer = socket.socketpair()
    new, new_peer = socket.socketpair()
    offers.put(0, 3, old)
    offers.put(0, 4, new)
    assert old.fileno() == -1  # replaced: closed
    assert offers.kept(0) == (4,) and offers.kept(1) is None
    current, current_peer = socket.socketpair()
    put_later = threading.Thread(target=offers.put, args=(0, 5, current))

    def stale(epoch: int) -> bool:
        """Epochs before 5 are over; the first one judged starts the thread offering epoch 5's stream."""
        if epoch < 5 and put_later.ident is None:
            put_later.start()  # its put waits for the lock, which the take releases only once waiting
        return epoch < 5

    said, sock = offers.take(0, time.monotonic() + 30, threading.Event(), missing="no stream", stale=stale)
    put_later.join()
    assert said == 5 and sock is current
    assert new.fileno() == -1  # epoch 4's: closed by the take
    assert offers.kept(0) is None
    for s in (new, current, old_peer, new_peer, current_peer):
        s.close()


def test_a_take_fails_by_its_deadline_its_abort_or_its_owner_closed_and_a_closed_owner_keeps_nothing() -> None:
    offers: Offers[int, None] = Offers("stage 1 of job j")
    with pytest.raises(RpcFailure) as failed:
        offers.take(0, time.monotonic(), threading.Event(), missing="stage 0 opened no stream")
    assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.message == "stage 1 of job j: stage 0 opened no stream"
    aborted = threading.Event()
    aborted.set()
    with pytest.raises(RpcFailure) as failed:
        offers.take(0, time.monotonic() + 30, aborted, missing="no stream")
    assert failed.value.code == grpc.StatusCode.CANCELLED
    kept, peer = socket.socketpair()
    offers.put(1, None, kept)
    offers.close()
    assert kept.fileno() == -1
    with pytest.raises(RpcFailure) as failed:
        offers.take(1, time.monotonic() + 30, threading.Event(), missing="no stream")
    assert failed.value.code == grpc.StatusCode.ABORTED
    late, late_peer = socket.socketpair()
    with pytest.raises(RpcFailure) as failed:
        offers.put(1, None, late)
    assert failed.value.code == grpc.StatusCode.NOT_FOUND
    for s in (late, peer, late_peer):
        s.close()


def test_a_waiting_take_fails_once_its_owner_is_closed() -> None:
    offers: Offers[int, None] = Offers("stage 1 of job j")
    failures: queue.Queue[RpcFailure] = queue.Queue()

    def take() -> None:
        try:
            offers.take(0, time.monotonic() + 60, threading.Event(), missing="no stream")
        except RpcFailure as exc:
            failures.put(exc)

    taker = threading.Thread(target=take)
    taker.start()
    offers.close()
    taker.join(timeout=30)
    assert failures.get_nowait().code == grpc.StatusCode.ABORTED
