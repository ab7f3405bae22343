"""Channels to agents, opened in one place: TLS to exactly the agent certificate the control plane registered
(arceus.wire.tls), every call carrying the caller's data-plane token (arceus.contracts.credentials), and the
message-size options every channel and agent server shares."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest
from grpc_health.v1.health_pb2_grpc import HealthStub

from arceus.contracts.certificates import AGENT_TLS_NAME
from arceus.contracts.credentials import METADATA_KEY, SCHEME
from arceus.relay import dialer
from arceus.relay.address import relayed_node

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
Continuation = Callable[..., Any]


def grpc_channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def open_channel(
    address: str,
    *,
    token: str,
    certificate: str,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    options: list[tuple[str, Any]] | None = None,
) -> grpc.Channel:
    """A TLS channel to the agent at `address` that trusts only `certificate` (its registered one, PEM) and whose
    calls present `token`; `options` replace the size options. A relayed address goes through a relay, the TLS
    and the token still end to end (arceus.relay.dialer)."""
    channel = _pinned_channel(address, certificate, options or grpc_channel_options(max_message_bytes))
    return grpc.intercept_channel(channel, _BearerToken(token))


def agents_answering(
    targets: Sequence[tuple[str, str]], *, timeout: float, concurrency: int, refused_is_down: bool = False
) -> list[bool]:
    """Whether each agent, given as (address, its registered certificate), completes a TLS handshake pinned to that
    certificate and answers its health check (which takes no token) within `timeout` seconds. Dialled `concurrency`
    at a time on one event loop: agents behind routers that drop the dial cost a whole timeout each, so thousands
    of them take count × timeout / concurrency seconds, not count × timeout. A refused connection is retried
    until the timeout (an agent starting up), or with `refused_is_down` answers False at once (an agent that was
    serving a moment ago and now refuses has died)."""
    return asyncio.run(_answering(targets, timeout, concurrency, not refused_is_down))


async def _answering(
    targets: Sequence[tuple[str, str]], timeout: float, concurrency: int, wait_for_ready: bool
) -> list[bool]:
    gate = asyncio.Semaphore(concurrency)

    async def answers(address: str, certificate: str) -> bool:
        async with gate:
            try:
                _check_pinned(address, certificate)
                async with grpc.aio.secure_channel(address, pinned_channel_credentials(certificate),
                                                   options=_pinned_options(address, [])) as channel:
                    check = HealthStub(channel).Check
                    await check(HealthCheckRequest(), timeout=timeout, wait_for_ready=wait_for_ready)
                return True
            except (grpc.RpcError, ValueError):
                return False

    return list(await asyncio.gather(*(answers(address, certificate) for address, certificate in targets)))


def exchanges_answering(targets: Sequence[tuple[str, str]], *, timeout: float, concurrency: int) -> list[bool]:
    """Whether each agent's replicas' exchange listener, given as (HOST:PORT, the agent's registered certificate),
    completes a TLS 1.3 handshake presenting exactly that certificate within `timeout` seconds, `concurrency` at a
    time. The dialer shows no certificate of its own: the listener lets in only siblings that one of its steps named
    (nodeagent/exchange_stream.py) and drops it once the handshake is done, but only the node's agent holds the key of
    the certificate it presented by then. A refused connection answers False at once: the agent it belongs to
    answered on its gRPC port, so its listener is up, just not there."""
    return asyncio.run(_exchanges(targets, timeout, concurrency))


async def _exchanges(targets: Sequence[tuple[str, str]], timeout: float, concurrency: int) -> list[bool]:
    gate = asyncio.Semaphore(concurrency)

    async def answers(address: str, certificate: str) -> bool:
        async with gate:
            host, _, port = address.rpartition(":")
            try:
                _check_pinned(address, certificate)
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                context.minimum_version = ssl.TLSVersion.TLSv1_3
                context.check_hostname = False  # pinned: exactly this certificate is trusted
                context.load_verify_locations(cadata=certificate)
                async with asyncio.timeout(timeout):
                    _, writer = await asyncio.open_connection(host.strip("[]"), int(port), ssl=context,
                                                              server_hostname="")
            except (OSError, ValueError, TimeoutError):  # ssl.SSLError is an OSError
                return False
            presented = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):  # the listener's alert: it lets no stranger in
                await asyncio.wait_for(writer.wait_closed(), timeout)
            return presented == ssl.PEM_cert_to_DER_cert(certificate)

    return list(await asyncio.gather(*(answers(address, certificate) for address, certificate in targets)))


def _pinned_channel(address: str, certificate: str, options: list[tuple[str, Any]]) -> grpc.Channel:
    _check_pinned(address, certificate)
    return grpc.secure_channel(address, pinned_channel_credentials(certificate),
                               options=_pinned_options(address, options))


def _check_pinned(address: str, certificate: str) -> None:
    if not certificate:
        raise ValueError(f"no TLS certificate is pinned for the agent at {address}: it cannot be called")


def _pinned_options(address: str, options: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    options = [*options, ("grpc.ssl_target_name_override", AGENT_TLS_NAME)]
    if relayed_node(address) is not None:
        options.append(("grpc.http_proxy", dialer.proxy_url()))
    return options


_DETAILS_FIELDS = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")


def pinned_channel_credentials(certificate_pem: str) -> grpc.ChannelCredentials:
    """Credentials that trust exactly this agent certificate (arceus.wire.tls)."""
    return grpc.ssl_channel_credentials(root_certificates=certificate_pem.encode())


class _CallDetails(collections.namedtuple("_CallDetails", _DETAILS_FIELDS), grpc.ClientCallDetails):
    pass


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call's metadata."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("a channel to an agent needs the caller's data-plane token")
        self._entry = (METADATA_KEY, SCHEME + token)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), self._entry),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Continuation, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Continuation, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self, continuation: Continuation, details: grpc.ClientCallDetails, requests: Iterator[Any]
    ) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(
        self, continuation: Continuation, details: grpc.ClientCallDetails, requests: Iterator[Any]
    ) -> Any:
        return continuation(self._details(details), requests)
