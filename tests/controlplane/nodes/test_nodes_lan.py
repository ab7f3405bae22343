"""Agents on one LAN (controlplane/nodes/models.py `Node.address_for`): two nodes registering from the same public
address are handed each other's LAN address as their pipeline neighbour (certificates keyed the same way, and
their measured links mapped back), while a node elsewhere gets the usual address; the client's address is believed
only as far as the trusted proxies go (controlplane/common/client_ip.py)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from controlplane.controller.executor import reconcile_once
from controlplane.jobs.selectors import neighbour_nodes_by_address
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for
from tests.controlplane.conftest import agent_register

pytestmark = pytest.mark.django_db
HOME, ELSEWHERE = "203.0.113.7", "198.51.100.20"
CAPABILITIES = {"device_type": "cpu", "device_name": "cpu", "memory_bytes": 2**30, "flops_fp32": 1e9}


def register(user: User, name: str, public_ip: str, lan_address: str | None, **headers: str) -> tuple[Node, Any]:
    node, token = node_create(owner=user, name=name)
    client = APIClient(REMOTE_ADDR=public_ip, **headers)
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    address = f"{name}.example.org:50051"
    body = {"grpc_address": address, "capabilities": CAPABILITIES, "tls_certificate": identity_for(address).certificate}
    if lan_address is not None:
        body["lan_address"] = lan_address
    response = agent_register(client, body)
    assert response.status_code == 200, response.json()
    node.refresh_from_db()
    return node, client


def assignments(client: APIClient) -> list[dict[str, Any]]:
    response = client.post("/api/agent/heartbeat", {"observed": []}, format="json")
    assert response.status_code == 200, response.json()
    return response.json()["assignments"]


def pipeline_of_two(user: User, queued_job, first: tuple[str, str | None], second: tuple[str, str | None]):  # noqa: ANN001, ANN201
    """Two nodes registered from (public address, LAN address), hosting a two-stage job: [(node, its assignment)]."""
    nodes = [register(user, name, public_ip, lan) for name, (public_ip, lan) in zip("ab", (first, second),
                                                                                     strict=True)]
    for _, client in nodes:
        assignments(client)  # Ready
    queued_job(stages=2)
    reconcile_once()
    return [(node, assignments(client)[0]) for node, client in nodes]


def neighbour_address(assignment: dict[str, Any]) -> str:
    return assignment["next_address"] or assignment["prev_address"]


def test_neighbours_behind_one_public_address_dial_each_other_on_their_lan(user: User, queued_job) -> None:  # noqa: ANN001
    (a, for_a), (b, for_b) = pipeline_of_two(user, queued_job, (HOME, "192.168.1.10:50051"),
                                             (HOME, "192.168.1.11:50051"))
    assert a.public_ip == b.public_ip == HOME
    assert neighbour_address(for_a) == "192.168.1.11:50051" and neighbour_address(for_b) == "192.168.1.10:50051"
    # Pinned where it is dialled, and what an agent measures there is mapped back to its neighbour.
    assert for_a["certificates"] == {"192.168.1.11:50051": b.tls_certificate}
    assert neighbour_nodes_by_address(node=a) == {"192.168.1.11:50051": b.pk}


def test_neighbours_in_different_homes_dial_the_usual_address(user: User, queued_job) -> None:  # noqa: ANN001
    # The same private address in another home: never handed across homes.
    (a, for_a), (b, for_b) = pipeline_of_two(user, queued_job, (HOME, "192.168.1.10:50051"),
                                             (ELSEWHERE, "192.168.1.10:50051"))
    assert neighbour_address(for_a) == b.dial_address == "b.example.org:50051"
    assert neighbour_address(for_b) == a.dial_address
    assert for_a["certificates"] == {b.dial_address: b.tls_certificate}


def test_a_node_without_a_lan_address_is_dialled_as_usual_at_home(user: User, queued_job) -> None:  # noqa: ANN001
    (a, for_a), (b, for_b) = pipeline_of_two(user, queued_job, (HOME, "192.168.1.10:50051"), (HOME, None))
    assert neighbour_address(for_a) == b.dial_address
    assert neighbour_address(for_b) == "192.168.1.10:50051"


@pytest.mark.parametrize("address", ["127.0.0.1:5000", "8.8.8.8:5000", "0.0.0.0:5000", "lan.example.org:5000"])
def test_a_lan_address_must_be_a_private_ip(user: User, address: str) -> None:
    node, token = node_create(owner=user, name="n")
    client = APIClient(REMOTE_ADDR=HOME)
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    body = {"grpc_address": "n.example.org:1", "capabilities": CAPABILITIES, "lan_address": address,
            "tls_certificate": identity_for("n.example.org:1").certificate}
    response = agent_register(client, body)
    assert response.status_code == 400 and "lan_address" in response.json()["errors"]


def test_behind_a_trusted_proxy_the_forwarded_address_counts_and_a_forged_one_does_not(user: User, settings) -> None:  # noqa: ANN001
    settings.ARCEUS_TRUSTED_PROXIES = 1
    # The client claims 10.9.9.9; the proxy appends what it saw. REMOTE_ADDR is the proxy's own.
    node, _ = register(user, "p", "172.18.0.5", "192.168.1.10:1", HTTP_X_FORWARDED_FOR=f"10.9.9.9, {HOME}")
    assert node.public_ip == HOME
    unproxied, _ = register(user, "q", "172.18.0.5", "192.168.1.10:1")  # no header: it did not come through
    assert unproxied.public_ip is None
