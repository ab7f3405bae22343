"""The reconciler's snapshot keeps rows, views and layer costs between passes (controlplane/controller/snapshot.py):
every change to what a pass decides from is still seen at the very next pass. These tests commit their writes
(transaction=True), as the web server and the agents do, so the kept rows are used as in a control worker."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.controller.actions import DropReplicas, MarkNodeUnknown, RewindJob
from controlplane.controller.executor import execute, reconcile_once
from controlplane.controller.snapshot import NODE_ROWS, job_layers, load_snapshot
from controlplane.jobs.models import Job, Stage
from controlplane.nodes.liveness import lease_renew
from controlplane.nodes.models import Node, NodeLink, ReadyStatus

pytestmark = pytest.mark.django_db(transaction=True)


def _views() -> dict[str, object]:
    _, observed = load_snapshot()
    return {n.name: n for n in observed.nodes}


def test_a_steady_pass_reads_only_row_versions_of_unchanged_nodes(ready_node) -> None:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    first = NODE_ROWS.read()
    with CaptureQueriesContext(connection) as queries:
        again = NODE_ROWS.read()
    assert len(queries) == 1 and "xmin" in queries[0]["sql"]  # the versions, no row
    assert [a is b for a, b in zip(first, again, strict=True)] == [True] * 3


def test_an_owners_controls_and_capabilities_are_seen_at_the_next_pass(ready_node) -> None:
    node = ready_node("n0")
    assert not _views()["n0"].paused
    Node.objects.filter(pk=node.pk).update(paused=True)  # a queryset update: no save(), no signal
    assert _views()["n0"].pause_reason == "paused by its owner"
    Node.objects.filter(pk=node.pk).update(paused=False, flagged_at=timezone.now(), flag_reason="caught")
    assert _views()["n0"].pause_reason == "flagged: caught"
    Node.objects.filter(pk=node.pk).update(flagged_at=None, leaving_at=timezone.now())
    assert _views()["n0"].pause_reason == "its agent is leaving"
    Node.objects.filter(pk=node.pk).update(leaving_at=None, flops_fp32=7e9, memory_bytes=2**31)
    view = _views()["n0"]
    assert (view.paused, view.flops, view.declared_flops, view.memory_bytes) == (False, 7e9, 7e9, 2**31)
    Node.objects.filter(pk=node.pk).update(flops_measured=7e7)  # a driver timed it: its benchmark stays beside
    assert (_views()["n0"].flops, _views()["n0"].declared_flops) == (7e7, 7e9)
    Node.objects.filter(pk=node.pk).update(work_windows=["00:00-00:01"] if timezone.now().hour else ["12:00-12:01"])
    assert "working hours" in _views()["n0"].pause_reason


def test_liveness_and_readiness_are_seen_at_the_next_pass(ready_node) -> None:
    node = ready_node("n0")
    view = _views()["n0"]
    later = view.lease_renewed_at + timedelta(seconds=3)
    lease_renew(node_id=node.pk, now=later)  # Redis only: no row changes, the kept view is given its renewal
    assert _views()["n0"] == replace(view, lease_renewed_at=later)
    Node.objects.filter(pk=node.pk).update(idle_only=True, idle_cpu_threshold=0.5)
    assert not _views()["n0"].paused
    lease_renew(node_id=node.pk, now=later, host_busy_fraction=0.9)  # the same renewal, another host load
    assert "its owner is using it" in _views()["n0"].pause_reason
    Node.objects.filter(pk=node.pk).update(ready_status=ReadyStatus.UNKNOWN)
    assert _views()["n0"].ready_status == ReadyStatus.UNKNOWN


def test_a_nodes_measured_neighbour_link_is_seen_at_the_next_pass(ready_node) -> None:
    a, b = ready_node("n0"), ready_node("n1", port=50052)
    assert _views()["n0"].bandwidth_bytes_per_s == _views()["n1"].bandwidth_bytes_per_s  # unmeasured: the same
    NodeLink.objects.create(from_node=a, to_node=b, rtt_seconds=0.04, bandwidth_bytes_per_second=1e6,
                            measured_at=timezone.now())  # its node's row is left as it was
    assert (_views()["n0"].bandwidth_bytes_per_s, _views()["n0"].latency_s) == (1e6, 0.02)


def test_deleted_and_new_nodes_are_seen_at_the_next_pass(ready_node) -> None:
    ready_node("n0")
    assert set(_views()) == {"n0"}
    ready_node("n1", port=50052)
    assert set(_views()) == {"n0", "n1"}
    Node.objects.filter(name="n0").delete()
    assert set(_views()) == {"n1"}


def test_a_silent_node_loses_its_stage_at_the_next_pass(ready_node, queued_job) -> None:
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(4)]
    job = queued_job()
    reconcile_once()
    reconcile_once()  # steady: everything kept
    victim = Stage.objects.get(job=job, index=1).node_id
    later = timezone.now() + timedelta(seconds=20)
    for node in nodes:
        if node.pk != victim:
            lease_renew(node_id=node.pk, now=later)
    report = reconcile_once(now=later)
    assert {type(a) for a in report.applied} == {MarkNodeUnknown, RewindJob}
    assert Stage.objects.get(job=job, index=1, active=True).node_id not in (victim, None)


def test_a_jobs_config_status_and_stage_reports_are_seen_at_the_next_pass(ready_node, queued_job) -> None:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    reconcile_once()
    desired, observed = load_snapshot()
    [view] = desired.jobs
    assert view.status == "placing" and len(view.layers) == 3
    key = (str(job.id), 0, 0, 0)
    assert observed.stages[key].state != "ready"
    Stage.objects.filter(job=job, index=0).update(observed_generation=view.generation, observed_state="ready")
    config = {**job.model_config, "layer_sizes": [64, 32, 32, 32, 10]}
    Job.objects.filter(pk=job.pk).update(model_config=config)
    desired, observed = load_snapshot()
    assert observed.stages[key].state == "ready"
    assert len(desired.jobs[0].layers) == 4
    assert not any(s.timed for s in desired.jobs[0].stages)
    Stage.objects.filter(job=job, index=1).update(step_samples_per_second=250.0)  # the driver timed its node
    assert [s.timed for s in load_snapshot()[0].jobs[0].stages] == [False, True, False]
    assert desired.jobs[0].replica_sync_every == 1  # {}: exact, every step
    Job.objects.filter(pk=job.pk).update(replica_sync={"every_steps": 8, "outer_lr": 0.7, "outer_momentum": 0.9})
    assert load_snapshot()[0].jobs[0].replica_sync_every == 8
    Job.objects.filter(pk=job.pk).update(status="cancelled")
    assert load_snapshot()[0].jobs == ()


def test_a_dropped_replica_is_seen_at_the_next_pass(ready_node, queued_job) -> None:
    for i in range(6):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job(replicas={"min": 2, "max": 2})
    reconcile_once()
    [view] = load_snapshot()[0].jobs  # kept from here on
    assert view.released == ()
    row = Stage.objects.get(job=job, index=1, replica=1)
    now = timezone.now()
    drop = DropReplicas(str(job.id), view.generation, view.status, ((1, 1),), view.conditions)
    assert execute([drop], now=now).applied == [drop]
    assert load_snapshot()[0].jobs[0].released == ((str(row.node_id), now),)


def test_layer_costs_are_kept_by_the_configs_content() -> None:
    a = job_layers('{"layer_sizes": [4, 8, 2], "type": "mlp"}')
    assert job_layers('{"layer_sizes": [4, 8, 2], "type": "mlp"}') is a
    assert len(job_layers('{"layer_sizes": [4, 8, 8, 2], "type": "mlp"}')[0]) == 3
    layers, error = job_layers('{"layer_sizes": [4], "type": "mlp"}')
    assert layers == () and error is not None and "layer_sizes" in error


def test_inside_an_open_transaction_nothing_kept_is_trusted(ready_node) -> None:
    node = ready_node("n0")
    _views()
    with transaction.atomic():  # writes of one transaction share their row versions: the snapshot reads rows
        Node.objects.filter(pk=node.pk).update(paused=True)
        assert _views()["n0"].paused
        Node.objects.filter(pk=node.pk).update(paused=False, flops_fp32=3e9)
        assert _views()["n0"].flops == 3e9 and not _views()["n0"].paused
