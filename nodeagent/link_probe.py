"""`LinkProbeService`: the cheap RPC an agent times to measure its link to a pipeline neighbour, and the
client side that does the timing. Filler bytes only; nothing here touches torch or any stage."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from arceus.contracts.credentials import Role
from arceus.v1 import link_probe_pb2, link_probe_pb2_grpc
from arceus.wire.channels import open_channel
from nodeagent.callers import Guard, authorize, presented_digest
from nodeagent.rpc import RpcFailure

log = logging.getLogger(__name__)
MAX_PROBE_BYTES = 4 * 1024 * 1024  # either way: enough to time a link, too little to tie one up
# Room for the framing around a maximal payload; the channel refuses anything bigger.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_PROBE_BYTES + 1024),
    ("grpc.max_receive_message_length", MAX_PROBE_BYTES + 1024),
]


class LinkProbeServicer(link_probe_pb2_grpc.LinkProbeServiceServicer):
    def __init__(self, guards: Callable[[], list[Guard]]) -> None:
        """`guards`: whose calls the agent accepts now; any of them may time its link to this agent."""
        self._guards = guards

    def Probe(self, request: link_probe_pb2.ProbeRequest, context: grpc.ServicerContext) -> link_probe_pb2.ProbeReply:
        try:
            authorize(presented_digest(context), self._guards(), target=None, allowed=tuple(Role), method="Probe")
        except RpcFailure as failure:
            context.abort(failure.code, failure.message)
        if len(request.payload) > MAX_PROBE_BYTES or not 0 <= request.reply_bytes <= MAX_PROBE_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"probe payload ({len(request.payload)} bytes) and reply_bytes ({request.reply_bytes}) must "
                f"each lie in [0, {MAX_PROBE_BYTES}]",
            )
        return link_probe_pb2.ProbeReply(payload=bytes(request.reply_bytes))


# How many round trips a link's delay is the least of, how far apart, and how long they may take in all (each has
# its own deadline besides): spread over time, one is likely to find the machine idle.
DELAY_ROUNDS = 8
DELAY_SPACING_SECONDS = 0.25
DELAY_BUDGET_SECONDS = 5.0
# A least round trip this short (a loopback, a LAN; a gRPC call's own cost on a busy host included) ends the rounds
# early: what placement charges a stage for its link (a round trip per micro-batch) is then at most this much off.
DELAY_ENOUGH_SECONDS = 0.01


def least_delay(
    probe: Callable[[], float],
    *,
    rounds: int = DELAY_ROUNDS,
    spacing: float = DELAY_SPACING_SECONDS,
    budget: float = DELAY_BUDGET_SECONDS,
    enough: float = DELAY_ENOUGH_SECONDS,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """The least of up to `rounds` timings of `probe` (a round trip, in seconds), `spacing` seconds apart while none
    is at most `enough` (then back to back, three in all), none begun later than `budget` seconds after the first
    (which always runs). A loaded machine only adds to a round trip (a thread waiting for a core, a busy server's
    accept queue, a retransmitted SYN), never takes from it: the least is the link's own delay, where the best of
    three quick rounds taken while agents started beside each other on a busy host read 1.6-1.8 s on a loopback."""
    deadline = clock() + budget
    least = probe()
    for done in range(1, rounds):
        quiet = least <= enough
        if (quiet and done >= 3) or clock() + (0.0 if quiet else spacing) > deadline:
            break
        if not quiet:
            sleep(spacing)
        least = min(least, probe())
    return least


@dataclass(frozen=True)
class LinkFigures:
    rtt_seconds: float
    bandwidth_bytes_per_second: float


def measure_neighbour(
    address: str,
    token: str,
    certificate: str,
    *,
    timeout: float = 10.0,
    rtt_rounds: int = DELAY_ROUNDS,
    bulk_bytes: int = 2 * 1024 * 1024,
    bulk_rounds: int = 2,
) -> LinkFigures | None:
    """The link to the agent at `address` (presenting `token`, trusting `certificate`): the least of up to
    `rtt_rounds` empty probes (`least_delay`), and `bulk_bytes` sent one way (the fastest of `bulk_rounds`, less
    that round trip). None (logged) if any probe fails; every call has a deadline of `timeout` seconds."""
    try:
        with open_channel(address, token=token, certificate=certificate, options=_CHANNEL_OPTIONS) as channel:
            probe = link_probe_pb2_grpc.LinkProbeServiceStub(channel).Probe
            # The first call connects: kept out of the figures, which are the link's, not the handshake's.
            probe(link_probe_pb2.ProbeRequest(), timeout=timeout)
            rtt = least_delay(lambda: _timed(probe, b"", timeout), rounds=rtt_rounds)
            bulk = bytes(bulk_bytes)
            upload = min(_timed(probe, bulk, timeout) for _ in range(bulk_rounds))
    except grpc.RpcError as exc:
        log.warning("could not measure the link to %s: %s %s", address, exc.code(), exc.details())
        return None
    return LinkFigures(rtt, bulk_bytes / max(upload - rtt, 1e-6))


def _timed(probe: grpc.UnaryUnaryMultiCallable, payload: bytes, timeout: float) -> float:
    started = time.perf_counter()
    probe(link_probe_pb2.ProbeRequest(payload=payload), timeout=timeout)
    return time.perf_counter() - started
