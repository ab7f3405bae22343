"""An agent's own byte streams to its peers, outside gRPC: one mutual-TLS listener, dialling, and non-blocking frames
read straight into where they belong. Its users define what the streams carry: the replicas' exact exchange
(nodeagent.exchange_stream) and the neighbour streams (nodeagent.neighbour_stream); a stream a peer opened waits in
its owner's `Offers` until a step takes it.

Why not gRPC: a tensor pushed over gRPC Python's sync API crosses gRPC core's threads, is copied into Python `bytes`
by its server loop and handed to the step's thread through a mailbox: 3-4 thread wake-ups in 2 processes per tensor,
far more CPU per byte than a step can spare (docs/BENCHMARKS.md). Here the step's own thread sends and reads every
frame: `recv_into` the buffer it belongs in, no copy and no other thread.

Opening: a dialer reaches the peer's listener (at the stream address its agent registered, else at the listener's
port on the host of its gRPC address; a relayed peer's through its relay, arceus.relay.dialer.connect, which splices
the bytes onto that listener and sees only ciphertext), TLS 1.3 pinned both ways: the dialer trusts only the
certificate its step names for the peer, the listener only certificates its agent's steps named for peers (`trust`).
The dialer's first bytes are a fixed-size hello whose 4-byte magic names its kind (`HelloKind`); the kind's owner
checks the rest (who, for what, the dialer's token) and takes the stream or refuses it. The listener runs every
handshake and hello on one thread without blocking (at most `PENDING_HANDSHAKES` at once, each within
`HANDSHAKE_SECONDS`); a stranger costs a bounded slot for a few seconds, never a thread or a buffer of its choosing.

Frames (`FrameStream`): a fixed-size header, checked by the frame the reader expects next from that peer
(`Incoming.accept`) before a byte of its body is read; only then does the frame say where its body goes, so a peer
cannot make this agent allocate, and a frame other than the one due is refused."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import socket
import ssl
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import grpc

from arceus.relay import dialer as relay_dialer
from arceus.relay.address import EXCHANGE, relayed_address, relayed_node
from arceus.wire.tls import TlsIdentity
from nodeagent.rpc import RpcFailure

log = logging.getLogger(__name__)

PENDING_HANDSHAKES = 64  # connections the listener handshakes at once; more are closed at once
HANDSHAKE_SECONDS = 5.0  # a connection's handshake and hello, or it is closed
POLL_SECONDS = 0.05  # how often a wait looks whether its step was aborted
MAGIC_BYTES = 4  # every hello starts with its kind's magic
_SEND_BYTES = 1 << 20  # one TLS write at most (a write that would block is retried with the same bytes)
# A frame of at most this many bytes goes out as one TLS write (its pieces copied together): one record and one
# syscall, and its reader's header and body come out of one decrypted record (a small tensor's frame: header and
# payload apart cost a second write, record and read).
_JOIN_BYTES = 64 << 10


class StreamFailure(RpcFailure):
    """A stream broke, or carried what it must not: its owner closes it."""


K = TypeVar("K")
T = TypeVar("T")


class Offers(Generic[K, T]):
    """Streams peers opened to one owner (a stage, a replica), kept until a step of the owner's takes them: one per
    key (a newer replaces an older, which is closed), each with `T`, what its hello said that the taker checks. Put
    by the listener's thread, taken by a step's thread."""

    def __init__(self, owner: str) -> None:
        """`owner`: the owner in words, for errors ("stage 1 of job j")."""
        self._owner = owner
        self._lock = threading.Condition()
        self._offered: dict[K, tuple[T, ssl.SSLSocket]] = {}
        self._closed = False

    def put(self, key: K, said: T, sock: ssl.SSLSocket) -> None:
        """Keep `sock` under `key`; NOT_FOUND once the owner is closed (the listener closes the stream)."""
        with self._lock:
            if self._closed:
                raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"{self._owner} was just removed from this agent")
            old = self._offered.pop(key, None)
            self._offered[key] = (said, sock)
            self._lock.notify_all()
        if old is not None:
            old[1].close()

    def kept(self, key: K) -> tuple[T] | None:
        """What the stream kept under `key` said, boxed (T may be None); None while none is kept."""
        with self._lock:
            offered = self._offered.get(key)
        return None if offered is None else (offered[0],)

    def take(self, key: K, deadline: float, abort: threading.Event, *, missing: str,
             stale: Callable[[T], bool] = lambda said: False) -> tuple[T, ssl.SSLSocket]:
        """The stream kept under `key` and what it said, waited for: one `stale` says is over is closed and waited
        past. ABORTED once the owner is closed, CANCELLED once `abort` is set, DEADLINE_EXCEEDED (`missing`: what
        did not come, in words) past `deadline`."""
        with self._lock:
            while True:
                offered = self._offered.get(key)
                if offered is not None and not stale(offered[0]):
                    return self._offered.pop(key)
                if offered is not None:
                    del self._offered[key]
                    offered[1].close()
                if self._closed:
                    raise RpcFailure(grpc.StatusCode.ABORTED, f"{self._owner} was removed mid-step")
                if abort.is_set():
                    raise RpcFailure(grpc.StatusCode.CANCELLED, "the step was cancelled")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self._owner}: {missing}")
                self._lock.wait(min(remaining, POLL_SECONDS))

    def close(self) -> None:
        """Close every kept stream; a waiting `take` fails, and so does every later `put`."""
        with self._lock:
            self._closed = True
            offered, self._offered = list(self._offered.values()), {}
            self._lock.notify_all()
        for _, sock in offered:
            sock.close()


@dataclass(frozen=True)
class HelloKind:
    """A kind of stream the listener takes: its hello's size (the magic included), and its owner's `adopt`, which
    reads the hello (ValueError: malformed) and takes the stream or refuses it (RpcFailure; the listener closes it)."""

    size: int
    adopt: Callable[[bytes, ssl.SSLSocket], None]


class PeerStreams:
    """An agent's peer streams: its TLS identity, its listener for peers that dial it, and dialling."""

    def __init__(self, identity: TlsIdentity) -> None:
        self._identity = identity
        # Every agent certificate names the same subject, so one trust store holding several peers' certificates
        # would check a client against whichever it finds first. Each peer's certificate gets a context trusting it
        # alone, picked by the name the dialer sends (SNI: its certificate's fingerprint); unknown names get none.
        self._server = self._server_context()
        self._server.sni_callback = self._pick
        self._own_name = _tls_name(identity.certificate)
        self._trust_lock = threading.Lock()
        self._trusted: dict[str, ssl.SSLContext] = {}
        self._clients: dict[str, ssl.SSLContext] = {}
        self._listener: socket.socket | None = None
        self._kinds: dict[bytes, HelloKind] = {}
        self._stop = threading.Event()
        self._wake_reader, self._wake_writer = socket.socketpair()  # `close` wakes the listener's poll at once
        self._thread: threading.Thread | None = None
        self.port = 0

    def _server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        _load_identity(context, self._identity)
        return context

    def _pick(self, sock: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: ssl.SSLContext) -> None:
        with self._trust_lock:
            context = self._trusted.get(name or "")
        if context is not None:
            sock.context = context

    def trust(self, certificates: Iterable[str]) -> None:
        """Let peers holding these certificates (PEM, as the steps name them) complete a handshake here."""
        for pem in certificates:
            if not pem:
                continue
            name = _tls_name(pem)
            with self._trust_lock:
                if name in self._trusted:
                    continue
            context = self._server_context()
            context.load_verify_locations(cadata=pem)
            with self._trust_lock:
                self._trusted[name] = context

    def listen(self, host: str, kinds: Mapping[bytes, HelloKind], port: int = 0) -> None:
        """Listen on `host` at `port` (0: one the system picks; a router's port forward needs a fixed one), handing
        each authenticated stream to the kind its hello's magic names (`kinds`; any other magic is closed); the port
        listened on is `self.port`."""
        if not kinds or any(len(magic) != MAGIC_BYTES or kind.size <= MAGIC_BYTES for magic, kind in kinds.items()):
            raise ValueError(f"every kind of hello has a {MAGIC_BYTES}-byte magic and more bytes after it")
        host = host.strip("[]")
        if ":" in host:  # IPv6 ("::": every interface, IPv4 too where the system allows)
            self._listener = socket.create_server((host, port), family=socket.AF_INET6, backlog=PENDING_HANDSHAKES,
                                                  dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        else:
            self._listener = socket.create_server((host, port), backlog=PENDING_HANDSHAKES)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._kinds = dict(kinds)
        self._thread = threading.Thread(target=self._serve, name="peer-stream-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_writer.send(b"\0")
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        self._wake_reader.close()
        self._wake_writer.close()

    def dial(self, address: str, stream_address: str, port: int, certificate: str, hello: bytes, deadline: float,
             *, peer: str) -> ssl.SSLSocket:
        """A stream to `peer` (its description in errors) at `address` (at `stream_address` where the step names one,
        else its host at `port`, its listener; a relayed peer's through its relay), pinned to `certificate`, `hello`
        sent. UNAVAILABLE (or DEADLINE_EXCEEDED) naming the peer where it cannot be opened."""
        node = None if stream_address else relayed_node(address)
        if node is not None:
            where = relayed_address(node, EXCHANGE)
        else:
            where = stream_address or f"{address.rsplit(':', 1)[0]}:{port}"
            host, _, at = where.rpartition(":")
            if not host or not at.isdigit():
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"{peer}'s stream address {where!r} is not HOST:PORT")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"no time left to open the stream to {peer}")
        try:
            raw = (socket.create_connection((host.strip("[]"), int(at)), timeout=remaining) if node is None
                   else relay_dialer.connect(where, remaining))
        except OSError as exc:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"cannot reach {peer}'s stream listener at {where}: {exc}"
                             ) from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = self._client(certificate).wrap_socket(raw, server_hostname=self._own_name)
            if sock.getpeercert(binary_form=True) != ssl.PEM_cert_to_DER_cert(certificate):
                raise ssl.SSLError(f"{peer}'s listener presented another certificate")
            sock.sendall(hello)
            return sock
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE, f"the TLS stream to {peer} at {where} failed to open: {exc}"
            ) from None

    def _client(self, certificate: str) -> ssl.SSLContext:
        context = self._clients.get(certificate)
        if context is None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.check_hostname = False  # the certificate is pinned: exactly the one trusted, checked after
            context.load_verify_locations(cadata=certificate)
            _load_identity(context, self._identity)
            self._clients[certificate] = context
        return context

    def _serve(self) -> None:
        """Accept, handshake and read hellos, never blocking on one connection."""
        assert self._listener is not None
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_reader, select.POLLIN)
        pending: dict[int, _Handshake] = {}
        while not self._stop.is_set():
            now = time.monotonic()
            for fd in [fd for fd, h in pending.items() if h.deadline < now]:
                _drop(poller, pending.pop(fd), "handshake or hello not done in time")
            for fd, _ in poller.poll(POLL_SECONDS * 10 * 1000):
                if fd == self._listener.fileno():
                    self._accept(poller, pending)
                    continue
                handshake = pending.get(fd)
                if handshake is None:
                    continue
                try:
                    hello = handshake.advance(poller, self._kinds)
                except (OSError, ValueError) as exc:
                    _drop(poller, pending.pop(fd), str(exc))
                    continue
                if hello is None:
                    continue
                del pending[fd]
                poller.unregister(handshake.sock)
                try:
                    hello[0].adopt(hello[1], handshake.sock)
                except (RpcFailure, ValueError) as exc:
                    log.warning("a peer stream was refused: %s", exc.message if isinstance(exc, RpcFailure) else exc)
                    handshake.sock.close()
        for handshake in pending.values():
            handshake.sock.close()

    def _accept(self, poller: select.poll, pending: dict[int, _Handshake]) -> None:
        assert self._listener is not None
        while True:
            try:
                raw, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("peer stream listener: %s", exc)
                return
            if len(pending) >= PENDING_HANDSHAKES:
                raw.close()
                continue
            raw.setblocking(False)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = self._server.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            pending[sock.fileno()] = _Handshake(sock, time.monotonic() + HANDSHAKE_SECONDS)
            poller.register(sock, select.POLLIN)


class _Handshake:
    """An accepted connection until its hello is read: its magic first, then the rest its kind's size says."""

    def __init__(self, sock: ssl.SSLSocket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.done = False
        self.hello = bytearray(MAGIC_BYTES)
        self.kind: HelloKind | None = None
        self.got = 0

    def advance(self, poller: select.poll, kinds: Mapping[bytes, HelloKind]) -> tuple[HelloKind, bytes] | None:
        """Go on as far as the bytes in allow; the hello's kind and bytes once whole."""
        try:
            if not self.done:
                self.sock.do_handshake()
                self.done = True
            while self.kind is None or self.got < self.kind.size:
                n = self.sock.recv_into(memoryview(self.hello)[self.got:])
                if n == 0:
                    raise ValueError("closed before its hello")
                self.got += n
                if self.kind is None and self.got == MAGIC_BYTES:
                    self.kind = kinds.get(bytes(self.hello))
                    if self.kind is None:
                        raise ValueError("its hello is of no kind this listener takes")
                    self.hello.extend(bytes(self.kind.size - MAGIC_BYTES))
        except ssl.SSLWantReadError:
            poller.modify(self.sock, select.POLLIN)
            return None
        except ssl.SSLWantWriteError:
            poller.modify(self.sock, select.POLLOUT)
            return None
        return self.kind, bytes(self.hello)


def _drop(poller: select.poll, handshake: _Handshake, why: str) -> None:
    log.info("peer stream listener dropped a connection: %s", why)
    with contextlib.suppress(KeyError, ValueError):
        poller.unregister(handshake.sock)
    handshake.sock.close()


def _tls_name(certificate: str) -> str:
    """The name (SNI) a dialer holding `certificate` sends: its fingerprint, which picks the context trusting it."""
    return "x" + hashlib.sha256(ssl.PEM_cert_to_DER_cert(certificate)).hexdigest()[:40]


def _load_identity(context: ssl.SSLContext, identity: TlsIdentity) -> None:
    """ssl loads a key only from a file: one only this process can read, gone once loaded."""
    descriptor, path = tempfile.mkstemp(prefix="arceus-peer-stream-", suffix=".pem")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(identity.key_pem + identity.certificate_pem)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)


class Incoming(Protocol):
    """A frame a stream's reader waits for."""

    @property
    def what(self) -> str:
        """The frame in words, for errors ("its REDUCE shard at element 4 of step 1")."""

    def accept(self, header: bytes, sender: str) -> Sequence[memoryview]:
        """Check the header just read from `sender` (the stream's ends in words, "stage 1 replica 0 of job j: replica
        2") and say where the frame's body goes: views filled in order, each exactly as long as its bytes;
        StreamFailure where the header is not this frame's."""

    def done(self) -> None:
        """The body is in."""


class FrameStream:
    """One end of a peer stream, non-blocking, moved only by its owner's thread (`pump`): frames of a fixed-size
    header and a body; what it sends queued until the socket takes it, what it reads into the frames expected."""

    def __init__(self, sock: ssl.SSLSocket, header_size: int, peer: str, owner: str) -> None:
        """`peer`, `owner`: the two ends in words, for errors ("replica 2", "stage 1 replica 0 of job j")."""
        sock.setblocking(False)
        self.sock, self.peer, self._owner = sock, peer, owner
        self._out: deque[memoryview] = deque()
        self._expected: deque[Incoming] = deque()
        self._header = bytearray(header_size)
        self._body: list[memoryview] = []  # the views of the frame expected first still to fill, once its header is in
        self._got = 0  # bytes read of the header, or of the body's first view

    @property
    def idle(self) -> bool:
        return not self._out and not self._expected

    @property
    def sending(self) -> bool:
        return bool(self._out)

    def send(self, *pieces: bytes | memoryview) -> None:
        """Queue a frame's bytes (left untouched until sent; a small frame's pieces as one copy)."""
        views = [memoryview(p).cast("B") for p in pieces if len(p)]
        if len(views) > 1 and sum(v.nbytes for v in views) <= _JOIN_BYTES:
            views = [memoryview(b"".join(views))]
        self._out.extend(views)

    def expect(self, frame: Incoming) -> None:
        self._expected.append(frame)

    def next_expected(self) -> Incoming | None:
        return self._expected[0] if self._expected else None

    def pump(self) -> bool:
        """Send and read whatever the socket takes now; whether anything moved. StreamFailure on a broken stream or
        a frame other than the one expected."""
        try:
            return self._send() | self._receive()
        except (ssl.SSLError, OSError) as exc:
            raise StreamFailure(
                grpc.StatusCode.UNAVAILABLE, f"{self._owner}: the stream to {self.peer} broke: {exc}"
            ) from None

    def _send(self) -> bool:
        moved = False
        while self._out:
            piece = self._out[0][:_SEND_BYTES]
            try:
                n = self.sock.send(piece)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return moved
            moved = True
            if n == len(self._out[0]):
                self._out.popleft()
            else:
                self._out[0] = self._out[0][n:]
        return moved

    def _receive(self) -> bool:
        moved = False
        while self._expected:
            frame = self._expected[0]
            in_header = not self._body
            view = memoryview(self._header)[self._got:] if in_header else self._body[0][self._got:]
            try:
                n = self.sock.recv_into(view, len(view))
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return moved
            if n == 0:
                raise StreamFailure(grpc.StatusCode.UNAVAILABLE,
                                    f"{self._owner}: {self.peer} closed its stream before {frame.what}")
            moved = True
            self._got += n
            if n < len(view):
                continue
            self._got = 0
            if in_header:
                self._body = [v for v in frame.accept(bytes(self._header), f"{self._owner}: {self.peer}") if len(v)]
            else:
                self._body.pop(0)
            if not self._body:
                self._expected.popleft()
                frame.done()
        return moved

    def closed_by_peer(self) -> bool:
        """Whether the peer closed its end (between exchanges: nothing of this one was read yet). Peeks at the
        connection itself: a closed end reads as nothing, a live one has no bytes yet or this exchange's first."""
        try:
            return socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def pump_all(streams: Iterable[FrameStream], *, deadline: float, abort: threading.Event,
             done: Callable[[], bool], waiting_for: Callable[[], str]) -> None:
    """Move every stream until `done()`: each stream is sent to and read from as its socket allows, waiting in
    poll(2) when none moves. DEADLINE_EXCEEDED (naming `waiting_for()`) past `deadline`; CANCELLED once `abort` is
    set."""
    streams = list(streams)
    poller = select.poll()
    registered: dict[int, int] = {}
    while True:
        moved = False
        for stream in streams:
            moved |= stream.pump()
        if done():
            return
        if moved:
            continue
        if abort.is_set():
            raise RpcFailure(grpc.StatusCode.CANCELLED, "the step was cancelled")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, waiting_for())
        for stream in streams:
            events = (select.POLLIN if stream.next_expected() else 0) | (select.POLLOUT if stream.sending else 0)
            fd = stream.sock.fileno()
            if registered.get(fd) != events:
                if fd in registered:
                    poller.modify(fd, events)
                else:
                    poller.register(fd, events)
                registered[fd] = events
        poller.poll(min(remaining, POLL_SECONDS) * 1000)
