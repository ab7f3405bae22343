"""The caller's side of relays: a loopback HTTP CONNECT proxy, one per process, that gRPC channels to relayed
addresses (arceus.relay.address) go through (`grpc.http_proxy`, set by arceus.wire.channels.open_channel).
For each connection it tries the relays in the node's order until one has the agent attached, then splices the
channel's bytes (its TLS to the agent, end to end) onto that relay's Dial stream. The replicas' exchange streams,
outside gRPC, come through it too (`connect`), to the agent's exchange listener. A relay that died or lost the
agent fails the connection; gRPC reconnects through here and finds where the agent attached next."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Sequence

import grpc

from arceus.relay.address import relay_order, relayed_listener, relayed_node
from arceus.relay.channel import relay_channel
from arceus.relay.server import LISTENER_KEY, TARGET_KEY
from arceus.relay.splice import close, socket_chunks, write_replies
from arceus.v1 import relay_pb2_grpc

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 8192
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"

_lock = threading.Lock()
_relays: tuple[str, ...] = ()
_certificate = ""  # the relays' certificate, pinned (arceus.relay.channel)
_proxy: _ConnectProxy | None = None


def use_relays(relays: Sequence[str], certificate: str) -> None:
    """The relays this process may reach relayed agents through and their certificate (the operator's, as the
    control plane sends them)."""
    global _relays, _certificate
    with _lock:
        _relays, _certificate = tuple(relays), certificate


def proxy_url() -> str:
    """The URL of this process's proxy, started on first use."""
    global _proxy
    with _lock:
        if _proxy is None:
            _proxy = _ConnectProxy()
        return f"http://127.0.0.1:{_proxy.port}"


def connect(address: str, timeout: float) -> socket.socket:
    """A TCP connection to the listener the relayed `address` names, through whichever relay has its agent
    attached: the caller's bytes reach the agent's listener as they are (run TLS over it). OSError where no relay
    reaches the agent within `timeout` seconds."""
    if relayed_listener(address) is None:
        raise ValueError(f"{address} is not a relayed address")
    sock = socket.create_connection(("127.0.0.1", int(proxy_url().rpartition(":")[2])), timeout=timeout)
    try:
        sock.sendall(f"CONNECT {address} HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())
        answer = b""
        while not answer.endswith(b"\r\n\r\n"):  # byte by byte: what follows is the agent's
            data = sock.recv(1)
            if not data or len(answer) >= MAX_REQUEST_BYTES:
                raise ConnectionError(f"the relay dialer closed the connection to {address}")
            answer += data
        if answer != ESTABLISHED:
            status = answer.split(b"\r\n", 1)[0].decode("latin-1")
            raise ConnectionError(f"no relay reaches {address}: {status}")
        return sock
    except BaseException:
        sock.close()
        raise


class _Gate:
    """Holds a Dial stream's request reader until the relay has answered: only the chosen attempt reads."""

    def __init__(self) -> None:
        self._decided = threading.Event()
        self._open = False

    def decide(self, open_: bool) -> None:
        self._open = open_
        self._decided.set()

    def wait(self) -> bool:
        self._decided.wait()
        return self._open


class _ConnectProxy:
    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._channels: dict[tuple[str, str], grpc.Channel] = {}
        threading.Thread(target=self._accept, name="relay-dialer", daemon=True).start()

    def _accept(self) -> None:
        while True:
            sock, _ = self._listener.accept()
            threading.Thread(target=self._serve, args=(sock,), name="relay-dial", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            node_id, listener = self._read_connect(sock)
        except (OSError, ValueError) as exc:
            log.warning("relay dialer: refused a connection: %s", exc)
            _answer(sock, b"HTTP/1.1 400 Bad Request\r\n\r\n")
            return
        for relay in relay_order(node_id, _relays):
            gate = _Gate()
            try:
                stub = relay_pb2_grpc.RelayServiceStub(self._channel(relay))
            except ValueError as exc:  # no relay certificate to pin: no relay can be trusted
                log.warning("relay dialer: %s", exc)
                break
            replies = stub.Dial(socket_chunks(sock, before=gate.wait),
                                metadata=((TARGET_KEY, node_id), (LISTENER_KEY, listener)))
            try:
                next(replies)  # the empty "connected": the agent took the connection
            except grpc.RpcError as exc:
                gate.decide(False)
                log.info("relay %s cannot reach node %s: %s", relay, node_id, exc.code())
                continue
            sock.sendall(ESTABLISHED)
            gate.decide(True)
            write_replies(sock, replies)
            return
        log.warning("no relay of %s reaches node %s", list(_relays), node_id)
        _answer(sock, b"HTTP/1.1 502 Bad Gateway\r\n\r\n")

    def _channel(self, relay: str) -> grpc.Channel:
        with _lock:
            key = (relay, _certificate)
            if key not in self._channels:
                self._channels[key] = relay_channel(relay, _certificate)
            return self._channels[key]

    @staticmethod
    def _read_connect(sock: socket.socket) -> tuple[str, str]:
        """The node and its listener a CONNECT request (from this process's own gRPC, or `connect`) names."""
        request = b""
        while b"\r\n\r\n" not in request:
            data = sock.recv(1024)
            if not data or len(request) + len(data) > MAX_REQUEST_BYTES:
                raise ValueError("not a complete CONNECT request")
            request += data
        method, target, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        node_id = relayed_node(target) if method == "CONNECT" else None
        listener = relayed_listener(target)
        if node_id is None or listener is None:
            raise ValueError(f"expected CONNECT to a relayed address, got {method} {target}")
        return node_id, listener


def _answer(sock: socket.socket, status: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(status)
    close(sock)
