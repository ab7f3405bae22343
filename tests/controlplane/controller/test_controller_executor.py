"""The executor on a real database: actions apply once, and a pass acting on a stale view is skipped."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY

from controlplane.agents.services import node_heartbeat
from controlplane.common.conditions import get_condition
from controlplane.controller.actions import (
    MarkNodeUnknown,
    MovesHeld,
    PlaceJob,
    PlannedStage,
    RewindJob,
    SetCondition,
    StartDriver,
)
from controlplane.controller.executor import execute, reconcile_once
from controlplane.controller.rules import plan
from controlplane.controller.snapshot import load_snapshot
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.services import job_cancel
from controlplane.nodes.liveness import lease_renew
from controlplane.nodes.models import Node

pytestmark = pytest.mark.django_db


def test_a_pass_places_a_queued_job(ready_node, queued_job) -> None:
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(3)]
    job = queued_job()
    report = reconcile_once()
    assert [type(a) for a in report.applied] == [PlaceJob]
    assert report.reassigned == [str(job.id)]  # its nodes' new assignments are built ahead (tasks/control.py)
    job.refresh_from_db()
    assert job.status == "placing" and job.generation == 2
    stages = list(Stage.objects.filter(job=job).order_by("index"))
    assert [(s.layer_start, s.layer_end) for s in stages] == [(0, 1), (1, 2), (2, 3)]
    assert {s.node_id for s in stages} == {n.id for n in nodes}
    assert {s.generation for s in stages} == {2}
    # Level-triggered: the next pass finds nothing new to do but wait for the agents.
    again = reconcile_once()
    assert [type(a).__name__ for a in again.applied] == []


def test_the_same_plan_applied_twice_places_once(ready_node, queued_job) -> None:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    now = timezone.now()
    actions = plan(*load_snapshot(), now)
    assert execute(actions, now=now).applied == actions
    assert execute(actions, now=now).skipped == actions
    assert Stage.objects.filter(job=job).count() == 3


def test_a_plan_made_before_a_cancel_is_not_applied(ready_node, queued_job) -> None:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    now = timezone.now()
    actions = plan(*load_snapshot(), now)
    job_cancel(job=job)
    report = execute(actions, now=now)
    assert report.skipped == actions
    assert Stage.objects.filter(job=job).count() == 0


def test_the_database_refuses_a_second_active_stage_on_a_node(ready_node, queued_job) -> None:
    node = ready_node("only")
    first, second = queued_job(stages=1), queued_job(stages=1)
    now = timezone.now()
    actions = [
        PlaceJob(str(job.id), job.generation, (PlannedStage(0, 0, 3, str(node.id)),), ()) for job in (first, second)
    ]
    report = execute(actions, now=now)
    assert report.applied == actions[:1] and report.skipped == actions[1:]
    second.refresh_from_db()
    assert second.status == "queued"  # the whole action rolled back, not just the stage insert


def test_a_heartbeat_after_the_snapshot_cancels_marking_the_node_unknown(ready_node) -> None:
    node = ready_node("a", now=timezone.now() - timedelta(seconds=30))
    now = timezone.now()
    [action] = plan(*load_snapshot(), now)
    assert isinstance(action, MarkNodeUnknown)
    node_heartbeat(node=node, observed=[], now=now)
    assert execute([action], now=now).skipped == [action]
    node.refresh_from_db()
    assert node.ready_status == "True"
    # Without the heartbeat the node is marked.
    later = now + timedelta(seconds=30)
    report = execute(plan(*load_snapshot(), later), now=later)
    assert len(report.applied) == 1
    node.refresh_from_db()
    assert (node.ready_status, node.ready_reason, node.ready_message) == (
        "Unknown",
        "NodeLeaseExpired",
        "no heartbeat for 30s",
    )


def test_an_unclaimed_driver_start_is_enqueued_again_by_exactly_one_of_two_passes(
    ready_node, queued_job, django_capture_on_commit_callbacks
) -> None:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    reconcile_once()
    expired = timezone.now() - timedelta(seconds=1)
    # Started, but no driver task ever claimed the lease (the message was lost).
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="", driver_lease_expires_at=expired)
    now = timezone.now()
    snapshot = load_snapshot()
    first, second = plan(*snapshot, now), plan(*snapshot, now)
    assert [type(a) for a in first] == [StartDriver]
    with django_capture_on_commit_callbacks() as enqueued:
        report = execute(first, now=now)
        assert len(report.applied) == 1 and report.reassigned == []  # a driver restarted: nothing new for agents
        assert len(execute(second, now=now).skipped) == 1
    assert len(enqueued) == 1
    job.refresh_from_db()
    assert job.driver_lease_owner == "" and job.driver_lease_expires_at > now


def test_one_row_writes_applied_together_are_each_checked_against_what_the_pass_saw(
    ready_node, queued_job, django_capture_on_commit_callbacks
) -> None:
    for i in range(9):
        ready_node(f"n{i}", port=50051 + i)
    jobs = [queued_job() for _ in range(3)]
    for _ in jobs:
        reconcile_once()
    placing = [Job.objects.get(pk=j.pk) for j in jobs]
    now = timezone.now()
    condition = [{"type": "Note", "status": "True", "reason": "Test", "message": "", "last_transition": ""}]
    stale = placing[1].generation - 1
    actions = [
        SetCondition(str(placing[0].id), placing[0].generation, "placing", tuple(condition)),
        StartDriver(str(placing[1].id), stale, "placing", None, ()),  # another pass moved it on since
        StartDriver(str(placing[2].id), placing[2].generation, "placing", None, ()),
    ]
    with django_capture_on_commit_callbacks() as enqueued:
        report = execute(actions, now=now)
    assert sorted(report.applied, key=actions.index) == [actions[0], actions[2]] and report.skipped == [actions[1]]
    assert len(enqueued) == 1  # the one driver started, once the writes committed
    assert [Job.objects.get(pk=j.pk).status for j in jobs] == ["placing", "placing", "running"]
    assert Job.objects.get(pk=jobs[0].pk).conditions == condition


def test_a_dead_driver_rewinds_the_job_in_place_once_and_counts_a_restart(ready_node, queued_job) -> None:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    reconcile_once()
    job.refresh_from_db()
    placed = dict(Stage.objects.filter(job=job).values_list("index", "node_id"))
    expired = timezone.now() - timedelta(seconds=1)
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="dead", driver_lease_expires_at=expired)
    now = timezone.now()
    snapshot = load_snapshot()
    first, second = plan(*snapshot, now), plan(*snapshot, now)
    assert [type(a) for a in first] == [RewindJob]
    assert len(execute(first, now=now).applied) == 1
    assert len(execute(second, now=now).skipped) == 1
    job.refresh_from_db()
    assert job.status == "placing" and job.generation == 3 and job.restarts == 1
    assert job.driver_lease_owner == "" and job.driver_lease_expires_at is None
    assert dict(Stage.objects.filter(job=job).values_list("index", "node_id")) == placed
    assert set(Stage.objects.filter(job=job).values_list("generation", flat=True)) == {3}


def test_a_job_whose_driver_keeps_dying_without_progress_fails(ready_node, queued_job, settings) -> None:
    settings.ARCEUS_JOB_MAX_RESTARTS = 2
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    reconcile_once()
    expired = timezone.now() - timedelta(seconds=1)
    Job.objects.filter(pk=job.pk).update(
        status="running", driver_lease_owner="dead", driver_lease_expires_at=expired, restarts=2
    )
    report = reconcile_once()
    assert [type(a).__name__ for a in report.applied] == ["FailJob"]
    job.refresh_from_db()
    assert job.status == "failed" and job.conditions[-1]["reason"] == "BackoffLimitExceeded"


@pytest.mark.parametrize("status", ["placing", "running"])
def test_only_the_stage_on_a_lost_node_moves_to_a_spare(ready_node, queued_job, status) -> None:
    start = timezone.now() - timedelta(seconds=30)
    nodes = [ready_node(f"n{i}", port=50051 + i, now=start) for i in range(4)]
    job = queued_job(stages=2)
    reconcile_once(now=start)
    Job.objects.filter(pk=job.pk).update(status=status, driver_lease_owner="d", driver_lease_expires_at=timezone.now())
    placed = dict(Stage.objects.filter(job=job).values_list("index", "node_id"))
    lost_index = 0
    now = timezone.now()
    for node in nodes:  # every node but stage 0's keeps heartbeating
        if node.id != placed[lost_index]:
            node_heartbeat(node=node, observed=[], now=now)
    report = reconcile_once(now=now)
    assert [type(a).__name__ for a in report.applied] == ["MarkNodeUnknown", "RewindJob"]
    job.refresh_from_db()
    assert job.status == "placing" and job.generation == 3 and job.restarts == 0
    moved = dict(Stage.objects.filter(job=job).values_list("index", "node_id"))
    assert moved[1] == placed[1]  # the survivor stays
    assert moved[0] not in placed.values()  # the lost stage went to the spare
    assert "stage 0 moved from n" in job.conditions[0]["message"]
    assert Node.objects.get(pk=placed[lost_index]).ready_status == "Unknown"


def test_a_lost_stage_with_no_spare_waits_pending_then_resumes_on_a_new_node(ready_node, queued_job) -> None:
    start = timezone.now() - timedelta(seconds=30)
    nodes = [ready_node(f"n{i}", port=50051 + i, now=start) for i in range(2)]
    job = queued_job(stages=2)
    reconcile_once(now=start)
    lost = Stage.objects.get(job=job, node=nodes[0]).index
    now = timezone.now()
    node_heartbeat(node=nodes[1], observed=[], now=now)
    reconcile_once(now=now)
    job.refresh_from_db()
    assert job.status == "pending"
    placed = dict(Stage.objects.filter(job=job).values_list("index", "node_id"))
    assert placed[lost] is None and placed[1 - lost] == nodes[1].id
    placed_condition = next(c for c in job.conditions if c["type"] == "Placed")
    assert placed_condition["status"] == "False" and placed_condition["reason"] == "WaitingForNode"
    assert f"waiting for a Ready node with room for stage {lost}" in placed_condition["message"]
    assert reconcile_once(now=now).applied == []  # steady while nothing changes
    ready_node("n-new", port=50061, now=now)
    reconcile_once(now=now)
    job.refresh_from_db()
    assert job.status == "placing"
    assert Stage.objects.get(job=job, index=lost).node.name == "n-new"


def test_a_stage_that_fails_to_build_moves_to_a_spare_node(ready_node, queued_job) -> None:
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(3)]
    job = queued_job()
    reconcile_once()
    job.refresh_from_db()
    stage = Stage.objects.select_related("node").get(job=job, index=1)
    others = {s.index: s.node_id for s in Stage.objects.filter(job=job).exclude(index=1)}
    spare = ready_node("spare", port=50060)
    Stage.objects.filter(pk=stage.pk).update(
        observed_generation=job.generation, observed_state="failed", observed_message="CUDA out of memory"
    )
    reconcile_once()
    moved = Job.objects.get(pk=job.pk)
    assert (moved.status, moved.generation, moved.restarts) == ("placing", job.generation + 1, 1)
    assert Stage.objects.get(job=job, index=1).node == spare
    assert {s.index: s.node_id for s in Stage.objects.filter(job=job).exclude(index=1)} == others
    assert stage.node in nodes
    training = next(c for c in moved.conditions if c["type"] == "Training")
    assert f"failed: CUDA out of memory; moved from {stage.node.name} to spare" in training["message"]


def test_a_failed_stage_fails_the_job_and_frees_its_nodes(ready_node, queued_job) -> None:
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(3)]
    job = queued_job()
    reconcile_once()
    job.refresh_from_db()
    stage = Stage.objects.get(job=job, index=1)
    Stage.objects.filter(pk=stage.pk).update(
        observed_generation=job.generation, observed_state="failed", observed_message="CUDA out of memory"
    )
    reconcile_once()
    job.refresh_from_db()
    assert job.status == "failed"
    assert job.error == f"stage 1 on node {stage.node_id} failed: CUDA out of memory"
    assert not Stage.objects.filter(node__in=nodes, active=True).exists()


def test_a_pass_under_a_disruption_keeps_the_lost_stages_says_why_and_counts_them(
    ready_node, queued_job, settings, caplog
) -> None:
    """3 nodes of 4 hosting the job's stages fall silent at once (over ARCEUS_DISRUPTION_THRESHOLD, at least its
    minimum, lowered here): no stage moves, the job says why, the log says so and the metric counts the job."""
    settings.ARCEUS_DISRUPTION_MIN_NODES = 3
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(6)]
    job = queued_job()
    reconcile_once()
    hosts = set(Stage.objects.filter(job=job, active=True).values_list("node_id", flat=True))
    later = timezone.now() + timedelta(seconds=20)
    for node in nodes:
        if node.pk not in hosts:
            lease_renew(node_id=node.pk, now=later)
    held = REGISTRY.get_sample_value("arceus_lost_moves_held_total", {"reason": "NodesDisrupted"})
    with caplog.at_level(logging.WARNING, logger="controlplane.controller.executor"):
        report = reconcile_once(now=later)
    assert {type(a) for a in report.applied} == {MarkNodeUnknown, SetCondition, MovesHeld}
    assert "3 of 3 nodes hosting stages are silent at once: no lost stage moves (1 jobs wait" in caplog.text
    assert REGISTRY.get_sample_value("arceus_lost_moves_held_total", {"reason": "NodesDisrupted"}) == held + 1
    job.refresh_from_db()
    assert job.generation == 2 and set(Stage.objects.filter(job=job, active=True).values_list(
        "node_id", flat=True)) == hosts
    assert get_condition(job.conditions, "Placed")["reason"] == "NodesDisrupted"
