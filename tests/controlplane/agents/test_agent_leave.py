"""An agent that is shutting down says it is leaving: its node drains like a paused one (its stage moves,
it gets no new one) until the agent registers again."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job, Stage
from controlplane.nodes.models import Node
from controlplane.nodes.selectors import node_unavailable_reason
from controlplane.nodes.services import node_create
from tests.controlplane.agents.test_agent_api import agent_client, heartbeat, register

pytestmark = pytest.mark.django_db


def test_a_leaving_node_hands_its_stage_to_another_and_registering_again_clears_it(
    user, ready_node, queued_job
) -> None:
    now = timezone.now()
    spares = [ready_node(f"n{i}", port=50061 + i, now=now) for i in range(3)]
    node, token = node_create(owner=user, name="leaver")
    agent = agent_client(token)
    register(agent, "127.0.0.1:50051", flops_fp32=1e12)  # the fastest: the planner puts a stage on it
    heartbeat(agent)
    job = queued_job(stages=3)
    reconcile_once(now=now)
    assert Stage.objects.filter(job=job, node=node).exists()

    left = agent.post("/api/agent/leave")
    assert left.status_code == 200 and left.json() == {"node_id": str(node.id), "stages": 1}
    assert agent.post("/api/agent/leave").status_code == 200  # a repeat changes nothing
    node.refresh_from_db()
    assert node_unavailable_reason(node, timezone.now()) == "its agent is leaving"

    reconcile_once(now=timezone.now() + timedelta(seconds=1))
    job = Job.objects.get(pk=job.pk)
    assert not Stage.objects.filter(job=job, node=node).exists()
    assert {s.node_id for s in Stage.objects.filter(job=job)} <= {n.id for n in spares}
    training = next(c for c in job.conditions if c["type"] == "Training")
    assert training["reason"] == "NodeDrained" and "(its agent is leaving)" in training["message"]
    assert heartbeat(agent).json()["assignments"] == []  # the agent may exit now
    assert agent.post("/api/agent/leave").json()["stages"] == 0

    assert register(agent, "127.0.0.1:50051").status_code == 200  # the agent came back
    node.refresh_from_db()
    assert node.leaving_at is None and node_unavailable_reason(node, timezone.now()) is None


def test_a_leaving_node_gets_no_new_stage(user, ready_node, queued_job) -> None:
    now = timezone.now()
    ready_node("slow", port=50061, now=now)
    node, token = node_create(owner=user, name="leaver")
    agent = agent_client(token)
    register(agent, "127.0.0.1:50051", flops_fp32=1e12)
    heartbeat(agent)
    agent.post("/api/agent/leave")
    job = queued_job(stages=1)
    reconcile_once(now=now)
    assert Stage.objects.get(job=job).node.name == "slow"
    assert Node.objects.get(pk=node.pk).leaving_at is not None
