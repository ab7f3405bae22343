"""The agent's /metrics server: whoever can reach its port holds at most a few connections, briefly."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import requests
import torch

from arceus.contracts.credentials import token_digest
from nodeagent import metrics as agent_metrics
from nodeagent.metrics import AgentMetrics

TOKEN = "m" * 32
IDLE_SECONDS = 3.0  # a connection's time to send its request (10 s in the agent)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(agent_metrics, "MAX_SCRAPES", 2)
    monkeypatch.setattr(agent_metrics._QuietHandler, "timeout", IDLE_SECONDS)
    metrics = AgentMetrics(torch.device("cpu"))
    metrics.accept_scrapes(token_digest(TOKEN))
    port = metrics.serve("127.0.0.1", 0)
    try:
        yield port
    finally:
        metrics.stop()


def closed_by_server(connection: socket.socket, within: float) -> bool:
    connection.settimeout(within)
    try:
        return connection.recv(1) == b""
    except TimeoutError:
        return False


def test_connections_beyond_the_most_are_closed_and_idle_ones_time_out(served: int) -> None:
    idle = [socket.create_connection(("127.0.0.1", served)) for _ in range(2)]
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", served)) as third:
            assert closed_by_server(third, within=1.0)  # at once, not after IDLE_SECONDS: both slots are held
        assert all(closed_by_server(c, within=IDLE_SECONDS + 5) for c in idle)  # sent nothing in time
    finally:
        for connection in idle:
            connection.close()
    scraped = requests.get(f"http://127.0.0.1:{served}/metrics", params={"token": TOKEN}, timeout=5)
    assert scraped.status_code == 200 and "arceus_stage_assigned" in scraped.text


def test_stopping_twice_stops_once_and_frees_the_port() -> None:
    metrics = AgentMetrics(torch.device("cpu"))
    port = metrics.serve("127.0.0.1", 0)
    metrics.stop()
    metrics.stop()  # an agent stopped by its fixture after its own stop: no error
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
