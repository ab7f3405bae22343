"""The link shaper: its timing rule without sockets, then a real loopback proxy that delays, limits the
rate, keeps byte order and passes a half-close through."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from devtools.shaper import CHUNK_BYTES, LinkPlan, ShaperThread

MBIT = 1e6


def test_a_lone_chunk_arrives_after_the_delay() -> None:
    plan = LinkPlan(delay_s=0.02, rate_bps=100 * MBIT)
    assert plan.arrival(5.0, 1000) == pytest.approx(5.02)


def test_a_backlog_drains_at_the_rate_then_arrives_after_the_delay() -> None:
    plan = LinkPlan(delay_s=0.02, rate_bps=100 * MBIT)
    arrivals = [plan.arrival(0.0, CHUNK_BYTES) for _ in range(100)]
    assert arrivals == sorted(arrivals)
    # The first chunk is the bucket's burst; each further one waits for its tokens.
    assert arrivals[-1] == pytest.approx(0.02 + 99 * CHUNK_BYTES * 8 / (100 * MBIT))


def test_an_idle_link_refills_its_bucket_and_no_more() -> None:
    plan = LinkPlan(delay_s=0.0, rate_bps=8 * MBIT, burst_bytes=4000)
    for _ in range(10):
        plan.arrival(0.0, 4000)  # 40 ms of backlog
    assert plan.arrival(0.01, 4000) == pytest.approx(0.04)  # still queued behind it
    assert plan.arrival(10.0, 4000) == pytest.approx(10.0)  # idle: a full bucket
    assert plan.arrival(10.0, 4000) == pytest.approx(10.004)  # but only one bucket's worth


@pytest.mark.parametrize("args", [(-0.1, 1e6), (0.0, 0.0)])
def test_nonsense_links_are_refused(args: tuple[float, float]) -> None:
    with pytest.raises(ValueError):
        LinkPlan(*args)


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
        port = shaper.link(echo_server, delay_s=delay, rate_bps=rate)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
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
    assert 2 * delay <= round_trip < 2 * delay + 0.1
    assert echoed == payload
    # Both directions are limited, but pipelined: ~0.5 s at 1 MB/s plus the round trip.
    floor = (len(payload) - CHUNK_BYTES) * 8 / rate
    assert floor <= elapsed < floor + 2 * delay + 0.6
