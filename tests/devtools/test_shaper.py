"""The link shaper: a real loopback proxy that delays, limits the rate, keeps byte order and passes a
half-close through (its timing rule: tests/arceus/swarm/test_swarm_link.py)."""

from __future__ import annotations

import argparse
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from devtools.shaper import CHUNK_BYTES, ShaperThread, add_link_arguments, link_shape

MBIT = 1e6


@pytest.fixture
def echo_server() -> Iterator[str]:
    """A loopback server that echoes each connection until EOF, then closes it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    thread.join(timeout=10)


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = conn.recv(min(65536, n - got))
        assert part, f"connection closed after {got} of {n} bytes"
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def test_the_proxy_delays_limits_keeps_order_and_closes_cleanly(echo_server: str) -> None:
    delay, rate = 0.05, 8 * MBIT  # 1 MB/s each way
    payload = bytes(range(256)) * 2048  # 512 KiB, position-dependent so reordering would show
    with ShaperThread() as shaper:
        host, _, port = shaper.address(echo_server, delay_s=delay, rate_bps=rate).rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            start = time.perf_counter()
            conn.sendall(b"ping")
            assert recv_exactly(conn, 4) == b"ping"
            round_trip = time.perf_counter() - start
            sender = threading.Thread(target=conn.sendall, args=(payload,))
            start = time.perf_counter()
            sender.start()
            echoed = recv_exactly(conn, len(payload))
            elapsed = time.perf_counter() - start
            sender.join(timeout=10)
            conn.shutdown(socket.SHUT_WR)  # the EOF travels through; the server closes; we read EOF
            assert conn.recv(1) == b""
        late = shaper.take_lateness()
        assert shaper.take_lateness() == []  # taken
    # Every chunk each way (a read takes at most CHUNK_BYTES) was delivered, none before its planned arrival (asyncio
    # runs a timer up to its clock resolution early).
    assert len(late) >= 2 * (len(payload) // CHUNK_BYTES) and min(late) > -1e-3
    assert 2 * delay <= round_trip < 2 * delay + 0.1
    assert echoed == payload
    # Both directions are limited, but pipelined: ~0.5 s at 1 MB/s plus the round trip.
    floor = (len(payload) - CHUNK_BYTES) * 8 / rate
    assert floor <= elapsed < floor + 2 * delay + 0.6


def test_a_bench_s_links_default_to_a_home_uplink() -> None:
    parser = argparse.ArgumentParser()
    add_link_arguments(parser)
    assert link_shape(parser.parse_args([])) == {"delay_s": 0.02, "rate_bps": 100e6}
    assert link_shape(parser.parse_args(["--delay-ms", "5", "--rate-mbit", "8"])) == {"delay_s": 0.005, "rate_bps": 8e6}


def test_a_reset_by_the_target_ends_the_callers_connection() -> None:
    """A target that dies with bytes unread resets its connection (a SIGKILLed agent): the caller's connection through
    the shaper ends too, one link delay later, as it would directly, though the caller is not sending (a push waiting
    for its ack): not held open until the caller writes again."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    accepted: list[socket.socket] = []
    arrived = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        arrived.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with ShaperThread() as shaper, listener:
        port = shaper.link(f"127.0.0.1:{listener.getsockname()[1]}", delay_s=0.02, rate_bps=100 * MBIT)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"a push the target never reads")
            assert arrived.wait(10)
            time.sleep(0.2)  # the bytes are in the target's receive buffer
            target = accepted[0]
            target.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            target.close()  # with unread bytes: a reset, not a FIN
            conn.settimeout(3.0)
            started = time.monotonic()
            try:
                ended = conn.recv(1) == b""
            except ConnectionResetError:
                ended = True
            assert ended and time.monotonic() - started < 1.0
    thread.join(timeout=10)
