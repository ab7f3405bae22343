"""Agents' links to their pipeline neighbours: real agents measure them and report them in heartbeats,
the control plane stores the latest per (from node, to node), and placement prefers them to the
control-plane link (the neighbour-link twin of tests/controlplane/jobs/test_jobs_links.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.assignment import Assignment
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.controller.executor import reconcile_once
from controlplane.controller.snapshot import node_views, registered_nodes
from controlplane.jobs.models import Stage
from controlplane.nodes.liveness import lease_of
from controlplane.nodes.models import Node, NodeLink
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for
from nodeagent.agent import Agent
from tests.controlplane.conftest import agent_register

pytestmark = pytest.mark.django_db
CAPABILITIES = {"device_type": "cpu", "device_name": "cpu", "memory_bytes": 2**30, "flops_fp32": 1e9,
                "link": {"rtt_seconds": 0.002, "bandwidth_bytes_per_second": 1e9}}


def agent_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    return client


def heartbeat(client: APIClient, **body: Any) -> Any:
    return client.post("/api/agent/heartbeat", {"observed": [], **body}, format="json")


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started = [Agent(device=torch.device("cpu"), link_probe_interval=300.0) for _ in range(2)]
    for a in started:
        a.start()
    try:
        yield started
    finally:
        for a in started:
            a.stop(grace=1)


@pytest.fixture
def pipeline(user, agents: list[Agent], queued_job) -> list[tuple[Node, APIClient, Agent]]:  # noqa: ANN001
    """Two registered nodes served by real agents, hosting the two stages of one job."""
    placed = []
    for i, a in enumerate(agents):
        node, token = node_create(owner=user, name=f"node-{i}")
        client = agent_client(token)
        body = {"grpc_address": a.advertise_address, "capabilities": CAPABILITIES,
                "tls_certificate": a.identity.certificate}
        response = agent_register(client, body, a.identity)
        assert response.status_code == 200, response.json()
        assert heartbeat(client).status_code == 200
        placed.append((node, client, a))
    queued_job(stages=2)
    reconcile_once()
    for _, client, a in placed:
        a.apply_assignments([Assignment.from_json(x) for x in heartbeat(client).json()["assignments"]])
    return placed


def measured(a: Agent, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while not (figures := a.neighbour_links.take()):
        assert time.monotonic() < deadline, "no neighbour link measured in time"
        time.sleep(0.05)
    return figures


def test_agents_report_their_neighbour_links_and_placement_uses_them(pipeline) -> None:  # noqa: ANN001
    (first, first_client, first_agent), (second, _, second_agent) = pipeline
    figures = measured(first_agent)
    assert [f["address"] for f in figures] == [second_agent.advertise_address]
    assert heartbeat(first_client, neighbour_links=figures).status_code == 200
    link = NodeLink.objects.get()
    assert (link.from_node_id, link.to_node_id) == (first.id, second.id)
    assert (link.rtt_seconds, link.bandwidth_bytes_per_second) == (
        figures[0]["rtt_seconds"], figures[0]["bandwidth_bytes_per_second"])
    views = {v.name: v.device() for v in node_views(registered_nodes())}
    assert views["node-0"].bandwidth_bytes_per_s == figures[0]["bandwidth_bytes_per_second"]
    assert views["node-0"].latency_s == figures[0]["rtt_seconds"] / 2
    assert views["node-1"].bandwidth_bytes_per_s == 1e9  # nothing reported yet: its control-plane link

    # Upserted: one row per pair, the latest figures; a failed probe makes the link unknown again.
    newer = [{**figures[0], "bandwidth_bytes_per_second": 123.0}]
    assert heartbeat(first_client, neighbour_links=newer).status_code == 200
    assert NodeLink.objects.get().bandwidth_bytes_per_second == 123.0
    unknown = [{**figures[0], "rtt_seconds": None, "bandwidth_bytes_per_second": None}]
    assert heartbeat(first_client, neighbour_links=unknown).status_code == 200
    assert not NodeLink.objects.exists()


def test_an_address_that_is_no_neighbour_is_ignored(pipeline, ready_node) -> None:  # noqa: ANN001
    (_, first_client, _), _ = pipeline
    ready_node("bystander", port=6001)
    report = [{"address": "127.0.0.1:6001", "rtt_seconds": 0.01, "bandwidth_bytes_per_second": 1e3}]
    assert heartbeat(first_client, neighbour_links=report).status_code == 200
    assert not NodeLink.objects.exists()


GOOD = {"address": "127.0.0.1:6001", "rtt_seconds": 0.01, "bandwidth_bytes_per_second": 1e6}


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ({"address": "x"}, "Expected a list of items"),
        ([{**GOOD, "address": "0.0.0.0:1"}], "listen-everywhere address"),
        ([{**GOOD, "address": "nowhere"}], "Must be HOST:PORT"),
        ([{**GOOD, "rtt_seconds": None}], "both set or both null"),
        ([{**GOOD, "bandwidth_bytes_per_second": -1.0}], "Must be greater than 0"),
        ([{**GOOD, "rtt_seconds": "0.1"}], "Must be a finite JSON number"),
        ([{**GOOD, "rtt_seconds": 601}], "less than or equal to 600"),
        ([{**GOOD, "jitter": 1}], "Unknown field"),
        ([{"address": GOOD["address"]}], "This field is required"),
        ([GOOD, GOOD], "each neighbour address may appear once"),
        ([{**GOOD, "address": f"10.0.0.1:{i + 1}"} for i in range(65)], "no more than 64"),
    ],
)
def test_malformed_link_reports_are_refused_and_change_nothing(user, links: Any, message: str) -> None:  # noqa: ANN001
    node, token = node_create(owner=user, name="agent")
    client = agent_client(token)
    body = {"grpc_address": "127.0.0.1:6002", "capabilities": CAPABILITIES,
            "tls_certificate": identity_for("127.0.0.1:6002").certificate}
    assert agent_register(client, body).status_code == 200
    renewed = lease_of(node.pk, timezone.now()).renewed_at
    response = heartbeat(client, neighbour_links=links)
    assert response.status_code == 400
    assert message in str(response.json())
    assert lease_of(node.pk, timezone.now()).renewed_at == renewed
    assert not NodeLink.objects.exists()


def linked_nodes(user, count: int) -> list[Node]:  # noqa: ANN001
    nodes = []
    for i in range(count):
        node, _ = node_create(owner=user, name=f"node-{i}")
        now = timezone.now()
        node_register(node=node, grpc_address=f"10.0.0.{i + 1}:5005",
                      tls_certificate=identity_for(f"10.0.0.{i + 1}:5005").certificate,
                      device_type="cpu", device_name="cpu",
                      memory_bytes=2**30, flops_fp32=1e9, now=now, link=CAPABILITIES["link"])
        node_heartbeat(node=node, observed=[], now=now)
        nodes.append(node)
    return nodes


def test_the_worst_fresh_neighbour_link_stands_for_the_node(user, settings) -> None:  # noqa: ANN001
    """Lowest bandwidth and highest RTT among its fresh links, else its control-plane link, else unlimited."""
    a, b, c, d = linked_nodes(user, 4)
    now = timezone.now()
    NodeLink.objects.create(from_node=a, to_node=b, rtt_seconds=0.01, bandwidth_bytes_per_second=5e6, measured_at=now)
    NodeLink.objects.create(from_node=a, to_node=c, rtt_seconds=0.03, bandwidth_bytes_per_second=8e6, measured_at=now)
    stale = now - timedelta(seconds=settings.ARCEUS_NEIGHBOUR_LINK_MAX_AGE_SECONDS + 1)
    NodeLink.objects.create(from_node=b, to_node=a, rtt_seconds=1.0, bandwidth_bytes_per_second=1.0, measured_at=stale)
    views = {v.name: v.device() for v in node_views(registered_nodes(), now)}
    assert (views["node-0"].bandwidth_bytes_per_s, views["node-0"].latency_s) == (5e6, 0.015)  # worst of each
    assert (views["node-1"].bandwidth_bytes_per_s, views["node-1"].latency_s) == (1e9, 0.001)  # stale: its CP link
    Node.objects.filter(pk=d.pk).update(control_plane_rtt_seconds=None, control_plane_bandwidth_bytes_per_second=None)
    views = {v.name: v.device() for v in node_views(registered_nodes(), now)}
    assert views["node-3"].bandwidth_bytes_per_s == float("inf") and views["node-3"].latency_s == 0.0


@pytest.mark.parametrize(("bandwidth", "rtt", "stages"), [(None, None, 1), (1e9, 1e-6, 2), (1e3, 0.001, 1)])
def test_measured_neighbour_links_decide_how_many_stages_pay_off(
    user, queued_job, bandwidth: float | None, rtt: float | None, stages: int  # noqa: ANN001
) -> None:
    # Each control-plane link's 1 ms of latency alone would outweigh the ~100 µs of compute a cut
    # spreads (one stage); the links measured between the nodes decide instead.
    nodes = linked_nodes(user, 3)
    for src in nodes:
        for dst in nodes:
            if src != dst and bandwidth is not None:
                NodeLink.objects.create(from_node=src, to_node=dst, rtt_seconds=rtt,
                                        bandwidth_bytes_per_second=bandwidth, measured_at=timezone.now())
    job = queued_job(stages=None)
    reconcile_once()
    assert Stage.objects.filter(job=job, active=True).count() == stages
