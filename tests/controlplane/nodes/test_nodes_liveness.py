"""The lean heartbeat: the lease renewed in Redis (controlplane/nodes/liveness.py), no database write when nothing
changed, and assignments answered only when their version changed; the reconciler reads liveness from Redis."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.common.redis_client import redis_client
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Stage
from controlplane.nodes.liveness import BUSY, LEASES, SINCE, lease_of, lease_renew
from controlplane.nodes.models import Node
from tests.controlplane.agents.test_agent_api import heartbeat, three_agents

pytestmark = pytest.mark.django_db


def test_a_steady_heartbeat_writes_nothing_to_the_database_and_leaves_out_unchanged_assignments(user) -> None:
    [(node, client), *_] = three_agents(user)
    first = heartbeat(client).json()
    version = first["assignments_version"]
    before = lease_of(node.pk, timezone.now()).renewed_at
    with CaptureQueriesContext(connection) as queries:
        steady = client.post("/api/agent/heartbeat", {"observed": [], "assignments_version": version}, format="json")
    assert steady.status_code == 200
    assert "assignments" not in steady.json() and steady.json()["assignments_version"] == version
    statements = [q["sql"].split()[0].upper() for q in queries.captured_queries]
    assert statements == ["SELECT", "SELECT"], statements  # the token, the version: no write, no transaction
    assert lease_of(node.pk, timezone.now()).renewed_at > before  # the lease was renewed, in Redis


def test_a_placement_changes_the_version_and_the_assignments_come_back(user, queued_job) -> None:
    agents = three_agents(user)
    versions = {node.pk: heartbeat(client).json()["assignments_version"] for node, client in agents}
    job = queued_job()
    reconcile_once()
    for node, client in agents:
        answer = client.post(
            "/api/agent/heartbeat", {"observed": [], "assignments_version": versions[node.pk]}, format="json"
        ).json()
        assert answer["assignments_version"] != versions[node.pk]
        [assignment] = answer["assignments"]
        assert assignment["job_id"] == str(job.id)
        # A version from before, or none (an agent that does not send one), gets the whole list again.
        assert heartbeat(client).json()["assignments"] == [assignment]


def test_a_node_silent_in_redis_loses_its_stage_and_a_late_heartbeat_does_not_undo_the_move(user, queued_job) -> None:
    agents = dict(three_agents(user))
    job = queued_job()
    reconcile_once()
    three_agents(user, first=4)  # spares
    silent = Stage.objects.get(job=job, index=1).node
    lease_renew(node_id=silent.pk, now=timezone.now() - timedelta(seconds=60))
    reconcile_once()
    assert Node.objects.get(pk=silent.pk).ready_status == "Unknown"
    assert Stage.objects.get(job=job, index=1, active=True).node_id != silent.pk
    late = heartbeat(agents[silent]).json()
    assert late["assignments"] == []  # back, Ready, but its stage stays where it moved
    assert Node.objects.get(pk=silent.pk).ready_status == "True"


def test_after_redis_loses_the_leases_every_node_gets_a_whole_lease_from_then(user, queued_job) -> None:
    agents = three_agents(user)
    job = queued_job()
    reconcile_once()
    placed = dict(Stage.objects.filter(job=job, active=True).values_list("index", "node_id"))
    redis_client().delete(LEASES, SINCE)  # Redis restarted empty
    later = timezone.now() + timedelta(seconds=4)  # past the node's heartbeat, within a lease of the loss
    reconcile_once(now=later)
    assert dict(Stage.objects.filter(job=job, active=True).values_list("index", "node_id")) == placed
    assert all(Node.objects.get(pk=n.pk).ready_status == "True" for n, _ in agents)
    reconcile_once(now=later + timedelta(seconds=10))  # a whole lease (6 s) after the loss, still no heartbeat
    assert all(Node.objects.get(pk=n.pk).ready_status == "Unknown" for n, _ in agents)


@pytest.mark.django_db(transaction=True)
def test_a_deleted_nodes_lease_leaves_redis_with_it_also_when_its_owner_goes(user) -> None:
    """Every reconcile pass reads the whole lease set: deleted nodes' entries would cost each pass until pruned."""
    (kept, _), (deleted, _), (owners, _) = three_agents(user)
    other = type(user).objects.create_user(username="leaving-owner", password=None)
    Node.objects.filter(pk=owners.pk).update(owner=other)
    for node in (kept, deleted, owners):
        lease_renew(node_id=node.pk, now=timezone.now(), host_busy_fraction=0.5)
    gone = {str(deleted.pk), str(owners.pk)}
    deleted.delete()
    other.delete()  # its node goes in the cascade
    members = {m.decode() for m in redis_client().zrange(LEASES, 0, -1)}
    assert str(kept.pk) in members and not members & gone
    busy = {k.decode() for k in redis_client().hkeys(BUSY)}
    assert str(kept.pk) in busy and not busy & gone
