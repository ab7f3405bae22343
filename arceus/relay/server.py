"""The relay's gRPC service: agents attach (Attach), callers dial (Dial), and each caller's connection is paired
with a Carry stream its agent opens for it. The relay keeps nothing but these pairings in memory: a restarted
relay is empty, agents attach again (to it or another) and callers retry (arceus.relay.dialer)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator

import grpc

from arceus.relay.address import EXCHANGE, GRPC
from arceus.relay.splice import MAX_CHUNK_BYTES
from arceus.relay.tickets import METADATA_KEY as TICKET_KEY
from arceus.relay.tickets import TicketError, verify_ticket
from arceus.v1 import relay_pb2, relay_pb2_grpc

log = logging.getLogger(__name__)
TARGET_KEY = "arceus-relay-target"
LISTENER_KEY = "arceus-relay-listener"  # which of the agent's listeners a Dial is for (GRPC where absent)
LISTENERS = {GRPC: relay_pb2.GRPC, EXCHANGE: relay_pb2.EXCHANGE}
CONNECTION_KEY = "arceus-relay-connection"
PAIRING_SECONDS = 5.0  # an agent that does not take a caller's connection within this is not answering
MAX_WAITING_PER_NODE = 64  # callers waiting for one agent to take their connection
QUEUE_CHUNKS = 16  # per direction of a connection: what a slow reader lets the relay hold


class _Direction:
    """One direction of a paired connection: bounded (gRPC flow control pushes back on the writer)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_CHUNKS)
        self.closed = False

    async def put(self, data: bytes) -> None:
        if not self.closed:
            await self._queue.put(data)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        while self._queue.full():
            self._queue.get_nowait()  # the other side is leaving: what it did not read is dropped
        self._queue.put_nowait(None)

    async def replies(self) -> AsyncIterator[relay_pb2.Bytes]:
        while (data := await self._queue.get()) is not None:
            yield relay_pb2.Bytes(data=data)


class _Connection:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.taken = asyncio.get_running_loop().create_future()
        self.to_agent, self.to_caller = _Direction(), _Direction()

    def close(self) -> None:
        self.to_agent.close()
        self.to_caller.close()


class _Attachment:
    def __init__(self) -> None:
        self.incoming: asyncio.Queue[relay_pb2.Incoming | None] = asyncio.Queue()
        self.waiting = 0


async def _forward(requests: AsyncIterator[relay_pb2.Bytes], direction: _Direction, conn: _Connection) -> None:
    try:
        async for message in requests:
            await direction.put(message.data)
    except (grpc.RpcError, asyncio.CancelledError):
        pass
    finally:
        conn.close()  # either side ending ends the connection


class RelayServicer(relay_pb2_grpc.RelayServiceServicer):
    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._attached: dict[str, _Attachment] = {}
        self._waiting: dict[str, _Connection] = {}

    async def _node(self, context: grpc.aio.ServicerContext) -> str:
        ticket = dict(context.invocation_metadata() or ()).get(TICKET_KEY, "")
        try:
            return verify_ticket(self._secret, str(ticket), time.time())
        except TicketError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # abort raises; for the type checker

    async def Attach(  # noqa: N802 (gRPC method name)
        self, request: relay_pb2.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[relay_pb2.Incoming]:
        node_id = await self._node(context)
        attachment, replaced = _Attachment(), self._attached.get(node_id)
        if replaced is not None:
            replaced.incoming.put_nowait(None)  # the agent attached again: its older stream ends
        self._attached[node_id] = attachment
        log.info("node %s attached", node_id)
        try:
            yield relay_pb2.Incoming()  # attached: an empty id
            while (incoming := await attachment.incoming.get()) is not None:
                yield incoming
        finally:
            if self._attached.get(node_id) is attachment:
                del self._attached[node_id]
                log.info("node %s detached", node_id)

    async def Dial(  # noqa: N802
        self, requests: AsyncIterator[relay_pb2.Bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[relay_pb2.Bytes]:
        metadata = dict(context.invocation_metadata() or ())
        node_id = str(metadata.get(TARGET_KEY, ""))
        listener = LISTENERS.get(str(metadata.get(LISTENER_KEY, GRPC)))
        if listener is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{LISTENER_KEY} names no listener of an agent")
        attachment = self._attached.get(node_id)
        if attachment is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no agent of node {node_id!r} is attached to this relay")
        if attachment.waiting >= MAX_WAITING_PER_NODE:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many callers are waiting for this agent")
        connection_id = secrets.token_hex(16)
        conn = self._waiting[connection_id] = _Connection(node_id)
        attachment.waiting += 1
        attachment.incoming.put_nowait(relay_pb2.Incoming(connection_id=connection_id, listener=listener))
        try:
            await asyncio.wait_for(asyncio.shield(conn.taken), PAIRING_SECONDS)
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the agent of node {node_id} did not take the call")
        finally:
            attachment.waiting -= 1
            self._waiting.pop(connection_id, None)
        yield relay_pb2.Bytes()  # connected
        async for reply in _splice(requests, conn, conn.to_agent, conn.to_caller):
            yield reply

    async def Carry(  # noqa: N802
        self, requests: AsyncIterator[relay_pb2.Bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[relay_pb2.Bytes]:
        node_id = await self._node(context)
        connection_id = str(dict(context.invocation_metadata() or ()).get(CONNECTION_KEY, ""))
        conn = self._waiting.get(connection_id)
        if conn is None or conn.node_id != node_id or conn.taken.done():
            await context.abort(grpc.StatusCode.NOT_FOUND, "no caller is waiting on that connection for this node")
        conn.taken.set_result(True)
        async for reply in _splice(requests, conn, conn.to_caller, conn.to_agent):
            yield reply


async def _splice(
    requests: AsyncIterator[relay_pb2.Bytes], conn: _Connection, outbound: _Direction, inbound: _Direction
) -> AsyncIterator[relay_pb2.Bytes]:
    """One side of a relayed connection: what this side sends goes to `outbound` while what `inbound` holds
    comes back, until either side ends; then the connection closes for both."""
    pump = asyncio.create_task(_forward(requests, outbound, conn))
    try:
        async for reply in inbound.replies():
            yield reply
    finally:
        pump.cancel()
        conn.close()


def server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + 1024),
        ("grpc.max_send_message_length", MAX_CHUNK_BYTES + 1024),
        # Attachments idle for long stretches: keepalives notice a dead agent and keep home routers' NAT open.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ]
