"""An agent that cannot be dialled keeps one outbound stream to the relay the control plane assigned it
(`RelayAttachment.assign`, from each heartbeat answer). Each caller's connection the relay announces becomes a
Carry stream spliced onto a new loopback connection to the agent's own gRPC port, or to its exchange listener for
a sibling replica's exchange stream (the listener the caller named): the agent sees the caller's TLS as if it had
dialled directly, and checks its token or pinned certificate as it would (nodeagent/callers.py,
nodeagent/exchange_stream.py)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import grpc

from arceus.relay.channel import relay_channel
from arceus.relay.server import CONNECTION_KEY
from arceus.relay.splice import socket_chunks, write_replies
from arceus.relay.tickets import METADATA_KEY as TICKET_KEY
from arceus.v1 import relay_pb2, relay_pb2_grpc

log = logging.getLogger(__name__)
RETRY_SECONDS = 0.5
FAILURE_MEMORY_SECONDS = 30.0  # how long a relay it could not attach to is reported to the control plane


class RelayAttachment:
    def __init__(self, local_host: str, ports: dict[int, int]) -> None:
        """`local_host`: where the agent's listeners are reached from this machine; `ports`: each listener's port
        (relay_pb2.Listener -> port)."""
        self._local_host = local_host.strip("[]")
        self._ports = dict(ports)
        self._lock = threading.Lock()
        self._relay: str | None = None
        self._ticket = ""
        self._certificate = ""  # the relays' certificate, pinned (arceus.relay.channel)
        self._changed = threading.Event()
        self._attached: str | None = None
        self._failed: dict[str, float] = {}  # relay -> when attaching to it last failed
        self._call: grpc.Future | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-attachment", daemon=True)
        self._thread.start()

    def assign(self, relay: str | None, ticket: str, certificate: str) -> None:
        """The relay to stay attached to (None: the agent is dialled directly), a fresh ticket for it, and the
        relays' certificate to pin."""
        with self._lock:
            moved = relay != self._relay or certificate != self._certificate
            self._relay, self._ticket, self._certificate = relay, ticket, certificate
            call = self._call if moved else None
        if moved:
            self._changed.set()
            if call is not None:
                call.cancel()  # leave the old relay; the loop attaches to the new one

    def report(self) -> dict[str, object]:
        """What the heartbeat tells the control plane: where it is attached, and which relays failed it lately
        (the longest ago first)."""
        now = time.monotonic()
        with self._lock:
            by_age = sorted(self._failed.items(), key=lambda f: f[1])
            failed = [r for r, at in by_age if now - at < FAILURE_MEMORY_SECONDS]
            return {"attached": self._attached, "failed": failed}

    def stop(self) -> None:
        self._stop.set()
        self.assign(None, "", "")

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                relay, ticket, certificate = self._relay, self._ticket, self._certificate
                self._changed.clear()
            if relay is None:
                self._changed.wait()
                continue
            self._attach(relay, ticket, certificate)
            self._stop.wait(RETRY_SECONDS)

    def _attach(self, relay: str, ticket: str, certificate: str) -> None:
        try:
            channel = relay_channel(relay, certificate, options=[
                ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000)])
        except ValueError as exc:
            log.warning("relay %s: %s", relay, exc)
            with self._lock:
                self._failed[relay] = time.monotonic()
            return
        stub = relay_pb2_grpc.RelayServiceStub(channel)
        try:
            call = stub.Attach(relay_pb2.AttachRequest(), metadata=((TICKET_KEY, ticket),), wait_for_ready=False)
            with self._lock:
                if self._relay != relay:
                    call.cancel()
                    return
                self._call = call
            for incoming in call:
                with self._lock:
                    if self._attached != relay:
                        log.info("attached to relay %s", relay)
                    self._attached = relay
                    self._failed.pop(relay, None)
                if incoming.connection_id:  # the first, empty one says the relay took the attachment
                    threading.Thread(target=self._carry, args=(stub, incoming), daemon=True).start()
            raise grpc.RpcError("the relay ended the attachment")
        except grpc.RpcError as exc:
            with self._lock:
                cancelled = self._relay != relay or self._stop.is_set()
                self._attached = None
                if not cancelled:
                    self._failed[relay] = time.monotonic()
            if not cancelled:
                why = exc.code() if hasattr(exc, "code") else exc
                log.warning("relay %s: attachment failed (%s); retrying", relay, why)
        finally:
            channel.close()

    def _carry(self, stub: relay_pb2_grpc.RelayServiceStub, incoming: relay_pb2.Incoming) -> None:
        connection_id, port = incoming.connection_id, self._ports.get(incoming.listener)
        if port is None:
            log.warning("relayed connection %s: no listener %d here", connection_id, incoming.listener)
            return
        try:
            sock = socket.create_connection((self._local_host, port), timeout=5)
            sock.settimeout(None)
        except OSError as exc:
            log.warning("relayed connection %s: own server unreachable: %s", connection_id, exc)
            return
        with self._lock:
            ticket = self._ticket
        replies = stub.Carry(socket_chunks(sock), metadata=((TICKET_KEY, ticket), (CONNECTION_KEY, connection_id)))
        write_replies(sock, replies)
