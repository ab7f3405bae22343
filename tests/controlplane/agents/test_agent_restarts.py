"""An agent that registers again while it hosts a stage restarts its job; one that does it too often, across
jobs, is flagged and placement stops giving it work until an operator clears the flag."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from arceus.contracts.status import JobStatus
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.services import job_cancel
from controlplane.nodes.models import Node, NodeRestart
from controlplane.nodes.selectors import node_unavailable_reason
from controlplane.nodes.services import node_flag_clear
from devtools.pipeline import identity_for

pytestmark = pytest.mark.django_db

@pytest.fixture
def t0() -> datetime:
    """Now: the reconciler reads the real clock, and later registrations (in the future) keep nodes Ready."""
    return timezone.now()


@pytest.fixture
def nodes(ready_node, settings) -> list[Node]:  # noqa: ANN001
    settings.ARCEUS_NODE_MAX_RESTARTS = 2
    settings.ARCEUS_NODE_RESTART_WINDOW_SECONDS = 3600
    return [ready_node(f"n{i}", port=50051 + i) for i in range(3)]


def restart(node: Node, now: datetime) -> Node:
    """The node's agent comes back as a fresh process (same address) and heartbeats; the reconciler's pass that
    the registration nudged follows."""
    address = node.grpc_address
    registered = node_register(node=Node.objects.get(pk=node.pk), grpc_address=address, device_type="cpu",
                               device_name="test cpu", memory_bytes=2**30, flops_fp32=1e9, now=now,
                               tls_certificate=identity_for(address).certificate)
    node_heartbeat(node=registered, observed=[], now=now)
    reconcile_once()
    return Node.objects.get(pk=node.pk)


def hosting(job: Job, node: Node) -> Stage | None:
    return Stage.objects.filter(job=job, node=node, active=True).first()


def test_restarts_while_hosting_flag_the_node_across_jobs(
    nodes: list[Node], queued_job, ready_node, t0: datetime  # noqa: ANN001
) -> None:
    first = queued_job()
    reconcile_once()
    node = nodes[1]
    assert hosting(first, node) is not None
    restart(node, t0)
    restart(node, t0 + timedelta(minutes=10))  # two restarts: the most allowed
    assert Node.objects.get(pk=node.pk).flagged_at is None
    assert hosting(first, node) is not None  # still its stage: only the job rewound

    job_cancel(job=first, now=t0 + timedelta(minutes=20))
    second = queued_job()
    reconcile_once()
    stage = hosting(second, node)
    assert stage is not None
    flagged = restart(node, t0 + timedelta(minutes=30))  # the third within the hour, in another job

    assert flagged.flagged_at == t0 + timedelta(minutes=30)
    reason = "restarted 3 times while hosting a stage within 3600 s (ARCEUS_NODE_MAX_RESTARTS allows 2)"
    assert flagged.flag_reason == reason
    assert node_unavailable_reason(flagged, timezone.now()) == f"flagged: {reason}"
    second.refresh_from_db()
    assert second.status == JobStatus.PENDING and hosting(second, node) is None  # its stage moved off at once
    assert Stage.objects.get(pk=stage.pk).node_id is None
    restarts = NodeRestart.objects.filter(node=node).values_list("job_id", flat=True)
    assert list(restarts) == [second.pk, first.pk, first.pk]

    reconcile_once()  # the only free node is the flagged one: the job waits
    assert Stage.objects.get(pk=stage.pk).node_id is None
    spare = ready_node("spare", port=50070)
    reconcile_once()
    assert Stage.objects.get(pk=stage.pk).node_id == spare.pk


def test_restarts_of_an_idle_node_or_older_than_the_window_do_not_count(
    nodes: list[Node], queued_job, t0: datetime  # noqa: ANN001
) -> None:
    node = nodes[1]
    for minute in range(5):  # nothing hosted: nothing lost, nothing counted
        restart(node, t0 + timedelta(minutes=minute))
    assert not NodeRestart.objects.exists()

    job = queued_job()
    reconcile_once()
    for at in (t0, t0 + timedelta(minutes=30), t0 + timedelta(minutes=61), t0 + timedelta(minutes=95)):
        restart(node, at)  # never more than two within an hour
    assert NodeRestart.objects.filter(node=node).count() == 4
    assert Node.objects.get(pk=node.pk).flagged_at is None and hosting(job, node) is not None
    restart(node, t0 + timedelta(minutes=100))  # 61, 95 and 100: three within the hour
    assert Node.objects.get(pk=node.pk).flagged_at is not None


def test_an_operator_clears_the_flag_and_the_restarts_before_it_are_forgiven(
    nodes: list[Node], queued_job, t0: datetime  # noqa: ANN001
) -> None:
    node = nodes[2]
    job = queued_job()
    reconcile_once()
    for minute in (0, 1, 2):
        restart(node, t0 + timedelta(minutes=minute))
    assert Node.objects.get(pk=node.pk).flagged_at is not None
    flag_reason = Node.objects.get(pk=node.pk).flag_reason
    assert node_flag_clear(node=Node.objects.get(pk=node.pk), now=t0 + timedelta(minutes=3), reason="disk replaced")
    assert not node_flag_clear(node=Node.objects.get(pk=node.pk), now=t0 + timedelta(minutes=3), reason="again")
    cleared = Node.objects.get(pk=node.pk)
    assert (cleared.flagged_at, cleared.flag_reason, cleared.flag_cleared_at) == (None, "", t0 + timedelta(minutes=3))
    assert cleared.flag_clear_reason == f"{flag_reason} -- cleared: disk replaced"

    reconcile_once()  # placeable again: the pending job's stage comes back to it (the only free node)
    assert hosting(job, node) is not None
    restart(node, t0 + timedelta(minutes=4))  # one since the clearing
    assert Node.objects.get(pk=node.pk).flagged_at is None


def test_a_restart_is_acted_on_once_however_many_passes_follow(nodes: list[Node], queued_job, t0) -> None:  # noqa: ANN001
    job = queued_job()
    reconcile_once()
    generation = Job.objects.get(pk=job.pk).generation
    restart(Stage.objects.filter(job=job).first().node, t0)
    for _ in range(3):
        reconcile_once()
    job.refresh_from_db()
    assert (job.generation, job.restarts) == (generation + 1, 1)
    assert [c["reason"] for c in job.conditions if c["type"] == "Training"] == ["NodeRestarted"]
