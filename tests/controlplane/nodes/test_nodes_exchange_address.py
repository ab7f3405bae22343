"""Where a node's replicas' exchange listener is dialled (`Node.exchange_address`): the address its agent registers
(advertised: a router's port forward), else the host of its gRPC address at the listener's port it registers. It is
checked like the gRPC address, stored, shown to the node's owner, and named to the driver for every replica (which
names it to the siblings in each step), blank for a relayed node (reached through its relay)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from controlplane.controller.executor import reconcile_once
from controlplane.jobs.selectors import job_replica_endpoints
from controlplane.nodes.models import Node, Reachability
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for
from tests.controlplane.conftest import agent_register

pytestmark = pytest.mark.django_db
CAPABILITIES = {"device_type": "cpu", "device_name": "cpu", "memory_bytes": 2**30, "flops_fp32": 1e9}


def register(user: User, name: str, **fields: Any) -> tuple[Node, APIClient, Any]:
    """Register node `name` (gRPC at `<name>.example.org:50051`) with the other `fields` of the body."""
    node, token = node_create(owner=user, name=name)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    address = f"{name}.example.org:50051"
    body = {"grpc_address": address, "capabilities": CAPABILITIES, "tls_certificate": identity_for(address).certificate,
            **fields}
    return node, client, agent_register(client, body)


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"exchange_address": "0.0.0.0:7000"}, "exchange_address", "listen-everywhere address"),
        ({"exchange_address": "[::]:7000"}, "exchange_address", "listen-everywhere address"),
        ({"exchange_address": "home.example.org"}, "exchange_address", "Must be HOST:PORT"),
        ({"exchange_address": "home.example.org:0"}, "exchange_address", "port in 1..65535"),
        ({"exchange_address": "bad host!:7000"}, "exchange_address", "is not a hostname or IP address"),
        ({"exchange_address": "::1:7000"}, "exchange_address", "IPv6 goes in brackets"),
        ({"exchange_address": "a" * 250 + ".org:7000"}, "exchange_address", "no more than 255 characters"),
        ({"exchange_address": 7000}, "exchange_address", "HOST:PORT"),
        ({"exchange_port": 0}, "exchange_port", "greater than or equal to 1"),
        ({"exchange_port": 65536}, "exchange_port", "less than or equal to 65535"),
        ({"exchange_port": "7000/x"}, "exchange_port", "valid integer"),
    ],
)
def test_an_exchange_address_or_port_that_cannot_be_dialled_is_refused_naming_it(
    user: User, fields: dict[str, Any], field: str, words: str
) -> None:
    node, _, response = register(user, "home", **fields)
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert list(errors) == [field] and words in " ".join(errors[field]), errors
    node.refresh_from_db()
    assert not node.is_registered and node.exchange_address == ""


@pytest.mark.parametrize(
    ("fields", "stored"),
    [
        # Behind a router: the port it forwards to the listener, on the address it advertises.
        ({"exchange_port": 7000, "exchange_address": "203.0.113.7:17000"}, "203.0.113.7:17000"),
        ({"exchange_port": 7000}, "home.example.org:7000"),  # directly reachable: its gRPC host
        ({}, ""),  # an agent that does not say: siblings ask its gRPC port for the listener's
    ],
)
def test_the_registered_exchange_address_is_stored_and_shown_to_the_owner(
    user: User, api: APIClient, fields: dict[str, Any], stored: str
) -> None:
    node, _, response = register(user, "home", **fields)
    assert response.status_code == 200, response.json()
    node.refresh_from_db()
    assert node.exchange_address == stored
    assert api.get(f"/api/nodes/{node.id}").json()["exchange_address"] == stored


def test_a_registration_replaces_the_exchange_address_of_the_one_before(user: User) -> None:
    node, client, _ = register(user, "home", exchange_port=7000, exchange_address="203.0.113.7:17000")
    address = "home.example.org:50051"
    body = {"grpc_address": address, "capabilities": CAPABILITIES, "tls_certificate": identity_for(address).certificate,
            "exchange_port": 7001}
    assert agent_register(client, body).status_code == 200  # the agent restarted without --advertise-exchange
    node.refresh_from_db()
    assert node.exchange_address == "home.example.org:7001"


def test_the_driver_is_told_each_replicas_registered_exchange_address_and_none_for_a_relayed_one(
    user: User, queued_job  # noqa: ANN001
) -> None:
    registered = {
        "behind-router": {"exchange_port": 7000, "exchange_address": "203.0.113.7:17000"},
        "direct": {"exchange_port": 7001},
        "relayed": {"exchange_port": 7002, "exchange_address": "198.51.100.20:17002"},
    }
    nodes = {}
    for name, fields in registered.items():
        node, client, response = register(user, name, **fields)
        assert response.status_code == 200, response.json()
        assert client.post("/api/agent/heartbeat", {"observed": []}, format="json").status_code == 200  # Ready
        nodes[name] = node
    Node.objects.filter(pk=nodes["relayed"].pk).update(reachability=Reachability.RELAYED)
    job = queued_job(stages=1, replicas={"min": 3, "max": 3}, requirements={"owner_diversity": False})
    reconcile_once()
    job.refresh_from_db()  # placed at the generation the reconciler set
    endpoints = {e.node_id: e for e in job_replica_endpoints(job=job, joining=False)}
    assert {endpoints[str(nodes[name].pk)].exchange_address for name in registered} == {
        "203.0.113.7:17000", "direct.example.org:7001", ""}
    relayed = endpoints[str(nodes["relayed"].pk)]
    assert relayed.exchange_address == "" and relayed.address == Node.objects.get(pk=nodes["relayed"].pk).dial_address
