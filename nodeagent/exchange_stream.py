"""The wire of the replicas' exact exchange (nodeagent.replicas): one mutual-TLS byte stream per pair of siblings,
opened once per membership epoch, whose frames are read straight into the exchange's preallocated vectors.

Why not gRPC: a shard pushed over gRPC Python crossed gRPC core's threads, was copied into Python `bytes` by its
server loop, handed to the step's thread through a mailbox, and acknowledged through a reader polled ten times a
second, far more CPU per sample than the replicas' budget (docs/BENCHMARKS.md, swarm_scaling). Here the step's own
thread sends and reads every frame: `recv_into` the vector it belongs in, no copy and no other thread.

Opening: the lower replica id asks the higher one `ReplicaService.ExchangePort` (answered once a RunStep of the
epoch reached it, so it trusts the dialer's certificate) and dials its exchange listener (at the sibling's
`ReplicaPeer.exchange_address`, the address its agent registered, else at that port on the host of its address; a
relayed sibling's through its relay, arceus.relay.dialer.connect, which splices the bytes onto that listener and sees
only ciphertext), TLS 1.3 pinned both ways: the dialer trusts only the
certificate its step names for the sibling, the listener only certificates its agent's steps named for siblings
(`ExchangeStreams.trust`), and the exchange adopting a stream checks it is exactly the sibling's. The dialer's first
bytes are a fixed-size hello naming job, stage, generation, both replicas, the epoch and the dialer's replica token.
The listener runs every handshake and hello on one thread without blocking (at most `PENDING_HANDSHAKES` at once,
each within `HANDSHAKE_SECONDS`), and hands a stream only to the hosted replica it names; a stranger costs a bounded
slot for a few seconds, never a thread or a buffer of its choosing.

Frames: a fixed header (step, epoch, phase, start element, element count, signature length) checked against the
one frame the exchange expects next from that sibling before a byte of payload is read, so a sibling cannot make
this agent allocate, and a frame of another step or epoch is refused."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from arceus.relay import dialer as relay_dialer
from arceus.relay.address import EXCHANGE, relayed_address, relayed_node
from arceus.wire.tls import TlsIdentity
from nodeagent.rpc import RpcFailure

log = logging.getLogger(__name__)

REDUCE, GATHER = 1, 2  # a member's partial of a chunk to its owner; the owner's sum back to every member
PHASES = {REDUCE: "REDUCE", GATHER: "GATHER"}
MAX_SIGNATURE_BYTES = 128  # an audited step's Ed25519 signature of a REDUCE frame (arceus.verify.receipts): 64
PENDING_HANDSHAKES = 64  # connections the listener handshakes at once; more are closed at once
HANDSHAKE_SECONDS = 5.0  # a connection's handshake and hello, or it is closed
POLL_SECONDS = 0.05  # how often a wait looks whether its step was aborted
_SEND_BYTES = 1 << 20  # one TLS write at most (a write that would block is retried with the same bytes)
_MAGIC_HELLO, _MAGIC_FRAME = b"AXH1", b"AXF1"
_MAX_ID = 64
# magic, job id (UTF-8, NUL-padded), stage, generation, target replica, source replica, epoch, source's replica token
HELLO = struct.Struct(f"!4s{_MAX_ID}sqqiiq{_MAX_ID}s")
# magic, step, epoch, phase, start element, element count, signature bytes
FRAME = struct.Struct("!4sqqBqqH")


@dataclass(frozen=True)
class Hello:
    job_id: str
    stage_index: int
    generation: int
    target: int
    source: int
    epoch: int
    token: str = ""  # sent by the dialer; the listener keeps only its digest
    token_digest: str = ""

    def pack(self) -> bytes:
        job, token = self.job_id.encode(), self.token.encode()
        if not 0 < len(job) <= _MAX_ID or not 0 < len(token) <= _MAX_ID:
            raise ValueError(f"a hello names a job id and a replica token of 1 to {_MAX_ID} bytes")
        return HELLO.pack(_MAGIC_HELLO, job, self.stage_index, self.generation, self.target, self.source, self.epoch,
                          token)

    @classmethod
    def unpack(cls, data: bytes | bytearray) -> Hello:
        magic, job, stage, generation, target, source, epoch, token = HELLO.unpack(data)
        if magic != _MAGIC_HELLO:
            raise ValueError("not an exchange stream's hello")
        return cls(job.rstrip(b"\0").decode(errors="replace"), stage, generation, target, source, epoch,
                   token_digest=hashlib.sha256(token.rstrip(b"\0")).hexdigest())


class StreamFailure(RpcFailure):
    """The stream to a sibling broke, or carried what it must not: the exchange closes every stream it holds."""


# What the listener hands an authenticated stream to: the hosted replica the hello names (nodeagent.replicas), which
# parks it for its exchange, or refuses it (RpcFailure).
Adopt = Callable[[Hello, ssl.SSLSocket], None]


class ExchangeStreams:
    """An agent's exchange streams: its TLS identity, its listener for siblings that dial it, and dialling."""

    def __init__(self, identity: TlsIdentity) -> None:
        self._identity = identity
        # Every agent certificate names the same subject, so one trust store holding several siblings' certificates
        # would check a client against whichever it finds first. Each sibling's certificate gets a context trusting it
        # alone, picked by the name the dialer sends (SNI: its certificate's fingerprint); unknown names get none.
        self._server = self._server_context()
        self._server.sni_callback = self._pick
        self._own_name = _tls_name(identity.certificate)
        self._trust_lock = threading.Lock()
        self._trusted: dict[str, ssl.SSLContext] = {}
        self._clients: dict[str, ssl.SSLContext] = {}
        self._listener: socket.socket | None = None
        self._adopt: Adopt | None = None
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
        """Let siblings holding these certificates (PEM, as the steps name them) complete a handshake here."""
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

    def listen(self, host: str, adopt: Adopt, port: int = 0) -> None:
        """Listen on `host` at `port` (0: one the system picks; a router's port forward needs a fixed one), handing
        each authenticated stream to `adopt`; the port listened on is `self.port`."""
        host = host.strip("[]")
        if ":" in host:  # IPv6 ("::": every interface, IPv4 too where the system allows)
            self._listener = socket.create_server((host, port), family=socket.AF_INET6, backlog=PENDING_HANDSHAKES,
                                                  dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        else:
            self._listener = socket.create_server((host, port), backlog=PENDING_HANDSHAKES)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._adopt = adopt
        self._thread = threading.Thread(target=self._serve, name="exchange-listener", daemon=True)
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

    def dial(self, address: str, exchange_address: str, port: int, certificate: str, hello: Hello,
             deadline: float) -> ssl.SSLSocket:
        """A stream to the sibling at `address` (at `exchange_address` where the step names one, else its host at
        `port`, its listener; a relayed sibling's through its relay), pinned to `certificate`, its hello sent.
        UNAVAILABLE (or DEADLINE_EXCEEDED) naming the sibling where it cannot be opened."""
        node = None if exchange_address else relayed_node(address)
        if node is not None:
            where = relayed_address(node, EXCHANGE)
        else:
            where = exchange_address or f"{address.rsplit(':', 1)[0]}:{port}"
            host, _, at = where.rpartition(":")
            if not host or not at.isdigit():
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"replica {hello.target}'s exchange address {where!r} is not HOST:PORT")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no time left to open the stream to replica {hello.target}")
        try:
            raw = (socket.create_connection((host.strip("[]"), int(at)), timeout=remaining) if node is None
                   else relay_dialer.connect(where, remaining))
        except OSError as exc:
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE, f"cannot reach replica {hello.target}'s exchange at {where}: {exc}"
            ) from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = self._client(certificate).wrap_socket(raw, server_hostname=self._own_name)
            if sock.getpeercert(binary_form=True) != ssl.PEM_cert_to_DER_cert(certificate):
                raise ssl.SSLError(f"replica {hello.target}'s listener presented another certificate")
            sock.sendall(hello.pack())
            return sock
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE,
                f"the TLS stream to replica {hello.target} at {where} failed to open: {exc}",
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
        assert self._listener is not None and self._adopt is not None
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
                    hello = handshake.advance(poller)
                except (OSError, ValueError) as exc:
                    _drop(poller, pending.pop(fd), str(exc))
                    continue
                if hello is None:
                    continue
                del pending[fd]
                poller.unregister(handshake.sock)
                try:
                    self._adopt(hello, handshake.sock)
                except RpcFailure as exc:
                    log.warning("exchange stream from replica %d refused: %s", hello.source, exc.message)
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
                log.warning("exchange listener: %s", exc)
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
    """An accepted connection until its hello is read."""

    def __init__(self, sock: ssl.SSLSocket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.done = False
        self.hello = bytearray(HELLO.size)
        self.got = 0

    def advance(self, poller: select.poll) -> Hello | None:
        """Go on as far as the bytes in allow; the hello once whole."""
        try:
            if not self.done:
                self.sock.do_handshake()
                self.done = True
            while self.got < HELLO.size:
                n = self.sock.recv_into(memoryview(self.hello)[self.got:])
                if n == 0:
                    raise ValueError("closed before its hello")
                self.got += n
        except ssl.SSLWantReadError:
            poller.modify(self.sock, select.POLLIN)
            return None
        except ssl.SSLWantWriteError:
            poller.modify(self.sock, select.POLLOUT)
            return None
        return Hello.unpack(self.hello)


def _drop(poller: select.poll, handshake: _Handshake, why: str) -> None:
    log.info("exchange listener dropped a connection: %s", why)
    with contextlib.suppress(KeyError, ValueError):
        poller.unregister(handshake.sock)
    handshake.sock.close()


def _tls_name(certificate: str) -> str:
    """The name (SNI) a dialer holding `certificate` sends: its fingerprint, which picks the context trusting it."""
    return "x" + hashlib.sha256(ssl.PEM_cert_to_DER_cert(certificate)).hexdigest()[:40]


def _load_identity(context: ssl.SSLContext, identity: TlsIdentity) -> None:
    """ssl loads a key only from a file: one only this process can read, gone once loaded."""
    descriptor, path = tempfile.mkstemp(prefix="arceus-exchange-", suffix=".pem")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(identity.key_pem + identity.certificate_pem)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)


@dataclass
class Expected:
    """A frame the exchange waits for: its header's fields, where its payload goes (`into`, exactly its bytes), and
    what is done once it is in (given the frame's signature)."""

    step: int
    epoch: int
    phase: int
    start: int
    length: int
    into: memoryview
    done: Callable[[bytes], None]


class Stream:
    """The exchange's end of one sibling's stream, non-blocking, moved only by the exchange's thread (`pump`)."""

    def __init__(self, sock: ssl.SSLSocket, peer: int, name: str) -> None:
        sock.setblocking(False)
        self.sock, self.peer, self._name = sock, peer, name
        self._out: deque[memoryview] = deque()
        self._expected: deque[Expected] = deque()
        self._header = bytearray(FRAME.size)
        self._signature = bytearray(MAX_SIGNATURE_BYTES)
        self._part = 0  # 0: the header, 1: the signature, 2: the payload of the frame expected first
        self._got = 0  # bytes of that part read
        self._signature_bytes = 0

    @property
    def idle(self) -> bool:
        return not self._out and not self._expected

    @property
    def sending(self) -> bool:
        return bool(self._out)

    def send(self, step: int, epoch: int, phase: int, start: int, payload: memoryview, signature: bytes = b"") -> None:
        """Queue a frame (`payload`: bytes of float32 values, left untouched until it is sent)."""
        header = FRAME.pack(_MAGIC_FRAME, step, epoch, phase, start, len(payload) // 4, len(signature))
        self._out.append(memoryview(header + signature))
        self._out.append(payload)

    def expect(self, frame: Expected) -> None:
        self._expected.append(frame)

    def next_expected(self) -> Expected | None:
        return self._expected[0] if self._expected else None

    def pump(self) -> bool:
        """Send and read whatever the socket takes now; whether anything moved. StreamFailure on a broken stream or
        a frame other than the one expected."""
        try:
            return self._send() | self._receive()
        except (ssl.SSLError, OSError) as exc:
            raise StreamFailure(
                grpc.StatusCode.UNAVAILABLE, f"{self._name}: the stream to replica {self.peer} broke: {exc}"
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
            if self._part == 0:
                view = memoryview(self._header)[self._got:]
            elif self._part == 1:
                view = memoryview(self._signature)[self._got:self._signature_bytes]
            else:
                view = frame.into[self._got:]
            try:
                n = self.sock.recv_into(view, len(view))
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return moved
            if n == 0:
                raise StreamFailure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self._name}: replica {self.peer} closed its stream before its {PHASES[frame.phase]} shard at "
                    f"element {frame.start} of step {frame.step}",
                )
            moved = True
            self._got += n
            if n < len(view):
                continue
            self._got = 0
            if self._part == 0:
                self._signature_bytes = self._check(frame)
                self._part = 1 if self._signature_bytes else 2
            elif self._part == 1:
                self._part = 2
            else:
                self._part = 0
                self._expected.popleft()
                frame.done(bytes(self._signature[:self._signature_bytes]))
        return moved

    def _check(self, frame: Expected) -> int:
        """The signature's length, once the header just read is exactly `frame`'s."""
        magic, step, epoch, phase, start, length, signature = FRAME.unpack(self._header)
        got = (magic, step, epoch, phase, start, length)
        wanted = (_MAGIC_FRAME, frame.step, frame.epoch, frame.phase, frame.start, frame.length)
        if got != wanted:
            raise StreamFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self._name}: replica {self.peer} sent a frame of step {step} epoch {epoch} phase {phase} at element "
                f"{start} of {length} elements where its {PHASES[frame.phase]} shard of step {frame.step} epoch "
                f"{frame.epoch} at element {frame.start} of {frame.length} elements was due",
            )
        if signature > (MAX_SIGNATURE_BYTES if phase == REDUCE else 0):
            raise StreamFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self._name}: replica {self.peer}'s {PHASES[phase]} shard carries a signature of {signature} bytes",
            )
        return signature

    def closed_by_peer(self) -> bool:
        """Whether the sibling closed its end (between exchanges: nothing of this one was read yet). Peeks at the
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


def pump_all(streams: Iterable[Stream], *, deadline: float, abort: threading.Event,
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
