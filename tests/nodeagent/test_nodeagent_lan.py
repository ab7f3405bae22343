"""The agent's LAN address (nodeagent/lan.py), found in a network namespace standing for a home (devtools/netns.py):
the private address its route to the control plane leaves from, with its gRPC port; none on loopback, or when the
agent listens on another interface."""

from __future__ import annotations

import random
import secrets
import subprocess
import sys
from collections.abc import Iterator

import pytest

from devtools.netns import NetworkNamespace


@pytest.fixture
def home() -> Iterator[NetworkNamespace]:
    ns = NetworkNamespace(f"lan{secrets.token_hex(4)}", random.randrange(1024, 65000))
    try:
        yield ns
    finally:
        ns.close()


def lan_address_in(ns: NetworkNamespace, control_plane: str, listen_host: str) -> str:
    code = f"from nodeagent.lan import lan_address; print(lan_address({control_plane!r}, {listen_host!r}, 50051))"
    return subprocess.run(ns.command([sys.executable, "-c", code]), capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def test_an_agent_in_a_home_reports_its_private_address(home: NetworkNamespace) -> None:
    control_plane = f"http://{home.host_address}:8000"
    assert lan_address_in(home, control_plane, "0.0.0.0") == f"{home.address}:50051"
    assert lan_address_in(home, control_plane, home.address) == f"{home.address}:50051"


def test_no_lan_address_on_loopback_or_another_interface(home: NetworkNamespace) -> None:
    assert lan_address_in(home, "http://127.0.0.1:8000", "0.0.0.0") == "None"  # the route leaves from loopback
    assert lan_address_in(home, f"http://{home.host_address}:8000", "127.0.0.1") == "None"  # not listening there
