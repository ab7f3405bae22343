"""Contributor controls: working hours, idle-only and caps. A node that may not work drains like a
paused one; agents report how busy their owner's machine is and receive the thread cap."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.agents.services import node_heartbeat, node_register
from controlplane.controller.executor import reconcile_once
from controlplane.controller.snapshot import load_snapshot
from controlplane.jobs.models import Job, Stage
from controlplane.nodes.availability import in_windows, parse_window, unavailable_reason
from controlplane.nodes.liveness import lease_of
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for
from tests.controlplane.conftest import agent_register

AT = datetime(2026, 1, 1, 23, 30, tzinfo=UTC)


def reason(**changes: object) -> str | None:
    fields = {"paused": False, "work_windows": [], "idle_only": False, "idle_cpu_threshold": 0.5,
              "host_busy_fraction": None, "now": AT, **changes}
    return unavailable_reason(**fields)  # type: ignore[arg-type]


def test_working_hours_may_wrap_past_midnight() -> None:
    assert in_windows([], AT)
    assert in_windows(["22:00-07:00"], AT) and in_windows(["22:00-07:00"], AT.replace(hour=6, minute=59))
    assert not in_windows(["22:00-07:00"], AT.replace(hour=7, minute=0))  # the end is exclusive
    assert in_windows(["09:00-17:00", "23:00-23:45"], AT)
    assert reason(work_windows=["09:00-17:00"]) == "outside its owner's working hours (09:00-17:00 UTC)"


@pytest.mark.parametrize("text", ["9:00-17:00", "25:00-01:00", "10:00-10:00", "10:00 - 11:00"])
def test_malformed_windows_say_the_expected_form(text: str) -> None:
    with pytest.raises(ValueError, match="HH:MM-HH:MM|is empty"):
        parse_window(text)


def test_idle_only_judges_the_owners_other_processes_and_pause_comes_first() -> None:
    assert reason(idle_only=True, host_busy_fraction=0.4) is None
    assert reason(idle_only=True, host_busy_fraction=0.9) == (
        "its owner is using it (other processes use 90% of the CPU, above the 50% allowed)"
    )
    assert reason(idle_only=False, host_busy_fraction=0.9) is None
    assert reason(idle_only=True, host_busy_fraction=None) is None  # nothing measured yet
    assert reason(paused=True, work_windows=["09:00-10:00"]) == "paused by its owner"


@pytest.mark.django_db
def test_owners_set_controls_and_strangers_cannot(api: APIClient, other_api: APIClient) -> None:
    node_id = api.post("/api/nodes", {"name": "laptop"}, format="json").json()["id"]
    controls = {"work_windows": ["22:00-07:00"], "idle_only": True, "idle_cpu_threshold": 0.3,
                "max_memory_bytes": 2**30, "max_threads": 1}
    response = api.put(f"/api/nodes/{node_id}/controls", controls, format="json")
    assert response.status_code == 200 and response.json()["controls"] == controls
    node = Node.objects.get(pk=node_id)
    assert (node.work_windows, node.idle_only, node.max_threads) == (["22:00-07:00"], True, 1)
    refused = other_api.put(f"/api/nodes/{node_id}/controls", {}, format="json")
    assert refused.status_code == 404
    bad = api.put(f"/api/nodes/{node_id}/controls", {"work_windows": ["9-5"], "idle_cpu_threshold": 2},
                  format="json")
    assert bad.status_code == 400
    errors = bad.json()["errors"]
    assert "not a window like 22:00-07:00" in errors["work_windows"][0]
    assert "idle_cpu_threshold" in errors
    assert Node.objects.get(pk=node_id).idle_cpu_threshold == 0.3  # nothing changed


@pytest.mark.django_db
def test_agents_report_host_load_and_receive_the_thread_cap(user) -> None:
    node, token = node_create(owner=user, name="laptop")
    Node.objects.filter(pk=node.pk).update(max_threads=2, max_memory_bytes=2**30)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    caps = {"device_type": "cpu", "device_name": "cpu", "memory_bytes": 2**33, "flops_fp32": 1e11}
    body = {"grpc_address": "10.0.0.1:5000", "capabilities": caps,
            "tls_certificate": identity_for("10.0.0.1:5000").certificate}
    assert agent_register(client, body).status_code == 200
    reply = client.post("/api/agent/heartbeat", {"observed": [], "host_busy_fraction": 0.75}, format="json")
    assert reply.status_code == 200 and reply.json()["controls"] == {"max_threads": 2, "max_memory_bytes": 2**30}
    assert lease_of(node.pk, timezone.now()).host_busy_fraction == 0.75
    bad = client.post("/api/agent/heartbeat", {"observed": [], "host_busy_fraction": 3}, format="json")
    assert bad.status_code == 400 and "host_busy_fraction" in bad.json()["errors"]


@pytest.mark.django_db
def test_a_node_whose_owner_gets_busy_hands_its_stage_to_another(user, ready_node, queued_job) -> None:
    now = timezone.now()
    nodes = [ready_node(f"n{i}", port=50051 + i, now=now) for i in range(4)]
    job = queued_job(stages=3)
    reconcile_once(now=now)
    busy_node = Stage.objects.get(job=job, index=1).node
    Node.objects.filter(pk=busy_node.pk).update(idle_only=True)
    node_heartbeat(node=busy_node, observed=[], now=now, host_busy_fraction=0.95)
    reconcile_once(now=now + timedelta(seconds=1))
    job.refresh_from_db()
    moved = Stage.objects.get(job=job, index=1)
    assert job.status == "placing" and moved.node_id != busy_node.id
    training = next(c for c in job.conditions if c["type"] == "Training")
    assert training["reason"] == "NodeDrained"
    assert "its owner is using it (other processes use 95%" in training["message"]
    assert moved.node_id in {n.id for n in nodes}


@pytest.mark.django_db
def test_the_memory_a_node_offers_is_capped_by_its_owner(user) -> None:
    node, _ = node_create(owner=user, name="big")
    node_register(node=node, grpc_address="10.0.0.1:5000",
                  tls_certificate=identity_for("10.0.0.1:5000").certificate,
                  device_type="cpu", device_name="cpu",
                  memory_bytes=64 * 2**30, flops_fp32=1e11, now=timezone.now())
    Node.objects.filter(pk=node.pk).update(max_memory_bytes=2**30)
    _, observed = load_snapshot()
    assert [n.memory_bytes for n in observed.nodes] == [2**30]
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_stages_get_what_a_node_offers_less_what_its_agent_holds_already(user) -> None:
    node, _ = node_create(owner=user, name="big")
    node_register(node=node, grpc_address="10.0.0.1:5000",
                  tls_certificate=identity_for("10.0.0.1:5000").certificate,
                  device_type="cpu", device_name="cpu",
                  memory_bytes=64 * 2**30, flops_fp32=1e11, runtime_bytes=300 * 2**20, now=timezone.now())
    _, observed = load_snapshot()
    assert [n.memory_bytes for n in observed.nodes] == [64 * 2**30 - 300 * 2**20]
    Node.objects.filter(pk=node.pk).update(max_memory_bytes=2**30)  # the owner's cap is for the whole agent
    _, observed = load_snapshot()
    assert [n.memory_bytes for n in observed.nodes] == [2**30 - 300 * 2**20]
    Node.objects.filter(pk=node.pk).update(max_memory_bytes=2**20)  # below what the agent holds: no room at all
    _, observed = load_snapshot()
    assert [n.memory_bytes for n in observed.nodes] == [0]
