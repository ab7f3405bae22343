"""Minting and listing nodes."""

from __future__ import annotations

import hashlib

import pytest
from rest_framework.test import APIClient

from controlplane.controller.executor import reconcile_once
from controlplane.nodes.models import Node

pytestmark = pytest.mark.django_db


def test_create_shows_the_token_once_and_stores_only_its_hash(api: APIClient) -> None:
    response = api.post("/api/nodes", {"name": "laptop"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert set(body) == {"id", "name", "token"}
    # Recognisable, and never read as a command-line option (`--token -abc` would be).
    assert body["token"].startswith("arceus_node_") and len(body["token"]) > 50
    node = Node.objects.get(pk=body["id"])
    assert node.token_hash == hashlib.sha256(body["token"].encode()).hexdigest()
    assert body["token"] not in str(api.get(f"/api/nodes/{body['id']}").json())


def test_create_needs_a_name(api: APIClient) -> None:
    response = api.post("/api/nodes", {}, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == {"name": ["This field is required."]}
    assert Node.objects.count() == 0


def test_list_and_detail_show_capabilities_readiness_and_current_stage(api: APIClient, ready_node, queued_job) -> None:
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(3)]
    api.post("/api/nodes", {"name": "unregistered"}, format="json")
    job = queued_job()
    reconcile_once()
    listed = {n["name"]: n for n in api.get("/api/nodes/").json()}
    assert set(listed) == {"n0", "n1", "n2", "unregistered"}
    n0 = listed["n0"]
    assert n0["owner"] == "alice"
    assert (n0["device_type"], n0["device_name"], n0["memory_bytes"], n0["flops_fp32"]) == (
        "cpu",
        "test cpu",
        2**30,
        1e9,
    )
    assert n0["grpc_address"] == "127.0.0.1:50051"
    assert n0["ready"]["status"] == "True" and n0["ready"]["reason"] == "AgentReady"
    assert n0["last_heartbeat_at"] is not None
    assert n0["current_stage"]["job_id"] == str(job.id)
    assert {n["current_stage"]["stage_index"] for n in listed.values() if n["current_stage"]} == {0, 1, 2}
    fresh = listed["unregistered"]
    assert fresh["ready"] == {
        "status": "Unknown",
        "reason": "NotRegistered",
        "message": "waiting for the agent to register",
        "last_transition_time": None,
    }
    assert fresh["last_heartbeat_at"] is None and fresh["current_stage"] is None
    assert api.get(f"/api/nodes/{nodes[0].id}").json() == n0


def test_another_users_nodes_are_neither_listed_nor_shown(api: APIClient, other_api: APIClient, ready_node) -> None:
    """Their addresses, certificates and current jobs are their owner's business; a missing node reads the same."""
    mine = ready_node("mine")
    theirs = other_api.post("/api/nodes", {"name": "theirs"}, format="json").json()["id"]
    assert [n["name"] for n in api.get("/api/nodes").json()] == ["mine"]
    assert [n["name"] for n in other_api.get("/api/nodes").json()] == ["theirs"]
    for path in (f"/api/nodes/{theirs}", f"/api/nodes/{theirs}/earnings"):
        assert api.get(path).json() == {"detail": f"node {theirs} not found"}
    assert other_api.get(f"/api/nodes/{mine.id}").status_code == 404


def test_unknown_node_is_a_404(api: APIClient) -> None:
    assert api.get("/api/nodes/00000000-0000-0000-0000-000000000000").status_code == 404
    assert api.get("/api/nodes/nope").json() == {"detail": "node nope not found"}


def test_the_owner_pauses_and_resumes_a_node_and_nobody_else_can(api: APIClient, other_api: APIClient) -> None:
    node_id = api.post("/api/nodes", {"name": "laptop"}, format="json").json()["id"]
    assert api.get(f"/api/nodes/{node_id}").json()["paused"] is False

    response = api.post(f"/api/nodes/{node_id}/pause")
    assert response.status_code == 200 and response.json()["paused"] is True
    node = Node.objects.get(pk=node_id)
    assert node.paused and node.paused_at is not None
    assert api.post(f"/api/nodes/{node_id}/pause").json()["paused"] is True  # idempotent

    refused = other_api.post(f"/api/nodes/{node_id}/resume")
    assert refused.status_code == 404 and refused.json()["detail"] == f"node {node_id} not found"
    assert Node.objects.get(pk=node_id).paused

    response = api.post(f"/api/nodes/{node_id}/resume")
    assert response.status_code == 200 and response.json()["paused"] is False
    assert Node.objects.get(pk=node_id).paused_at is None
    assert api.post("/api/nodes/not-a-uuid/pause").status_code == 404


def test_the_owner_rotates_a_node_token_and_the_old_one_stops_at_once(api: APIClient, other_api: APIClient) -> None:
    created = api.post("/api/nodes", {"name": "laptop"}, format="json").json()
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Node {created['token']}")
    assert agent.post("/api/agent/probe", b"", content_type="application/octet-stream").status_code == 200

    assert other_api.post(f"/api/nodes/{created['id']}/token/rotate").status_code == 404  # not theirs: unseen
    rotated = api.post(f"/api/nodes/{created['id']}/token/rotate")
    assert rotated.status_code == 200
    body = rotated.json()
    assert body["id"] == created["id"] and body["token"].startswith("arceus_node_")
    assert body["token"] != created["token"]

    refused = agent.post("/api/agent/probe", b"", content_type="application/octet-stream")
    assert refused.status_code == 401 and "invalid node token" in refused.json()["detail"]
    agent.credentials(HTTP_AUTHORIZATION=f"Node {body['token']}")
    assert agent.post("/api/agent/probe", b"", content_type="application/octet-stream").status_code == 200
    assert Node.objects.get(pk=created["id"]).token_hash == hashlib.sha256(body["token"].encode()).hexdigest()
