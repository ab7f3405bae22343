"""Replicated stages through the control plane's database (arceus/swarm): submitted over REST, placed with
`replicas.min` per stage, a lost replica dropped and a new one added at the same generation (no rewind), the
assignments and driver plan each replica gets, and what GET /api/jobs/ID shows."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from django.utils import timezone

from arceus.contracts.assignment import Assignment
from arceus.contracts.credentials import replica_token
from arceus.training.plan import ReplicaJoin
from controlplane.agents.services import node_heartbeat
from controlplane.controller.actions import PlannedStage, RewindJob, ServeJob
from controlplane.controller.executor import execute, reconcile_once
from controlplane.controller.snapshot import load_snapshot
from controlplane.controller.transitions import job_serve_place
from controlplane.driver.driving import train_plan
from controlplane.jobs.credentials import job_driver_token
from controlplane.jobs.models import DEFAULT_AUDIT_RATE, Job, Stage, StageContribution
from controlplane.jobs.selectors import assignments_for_node
from controlplane.jobs.services import job_start
from tests.controlplane.conftest import DIGITS_JOB


def test_replicas_are_checked_at_submit_with_errors_naming_the_field(api) -> None:
    def submit(**fields: object) -> dict:
        response = api.post("/api/jobs", {**DIGITS_JOB, **fields}, format="json")
        assert response.status_code == 400, response.content
        return response.json()["errors"]

    assert "at most 4 replicas" in submit(replicas=5)["replicas"][0]
    assert "at most 4 replicas" in submit(replicas={"min": 1, "max": 8})["replicas"][0]
    assert submit(replicas={"min": 3, "max": 2})["replicas.max"] == ["Must be at least min."]
    assert "replicas" in submit(replicas=0)
    assert "replicas" in submit(replicas="two")
    diloco = {"every_steps": 4}
    assert "spot-checked" in submit(replicas=2, replica_sync=diloco, audit_rate=0.1)["audit_rate"][0]
    # Replicas that sync every step are spot-checked like any stage, by default too; those that sync every few
    # steps are not.
    response = api.post("/api/jobs", {**DIGITS_JOB, "replicas": {"min": 1, "max": 3}}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["replicas"] == {"min": 1, "max": 3}
    assert response.json()["audit_rate"] == DEFAULT_AUDIT_RATE > 0
    checked = api.post("/api/jobs", {**DIGITS_JOB, "replicas": 2, "audit_rate": 1.0}, format="json")
    assert checked.status_code == 201 and checked.json()["audit_rate"] == 1.0
    unchecked = api.post("/api/jobs", {**DIGITS_JOB, "replicas": 2, "replica_sync": diloco}, format="json")
    assert unchecked.status_code == 201 and unchecked.json()["audit_rate"] == 0.0
    default = api.post("/api/jobs", DIGITS_JOB, format="json").json()
    assert default["replicas"] == {"min": 1, "max": 1}


def test_replica_sync_is_checked_by_the_contract_shown_and_reaches_every_replica(api, ready_node) -> None:
    def refused(**fields: object) -> dict:
        response = api.post("/api/jobs", {**DIGITS_JOB, **fields}, format="json")
        assert response.status_code == 400, response.content
        return response.json()["errors"]

    assert "replicas > 1" in refused(replica_sync={"every_steps": 4})["replica_sync"][0]
    assert "integer" in refused(replicas=2, replica_sync={"every_steps": 0})["replica_sync.every_steps"][0]
    assert "(0, 10]" in refused(replicas=2, replica_sync={"every_steps": 4, "outer_lr": -1})["replica_sync.outer_lr"][0]
    momentum = refused(replicas=2, replica_sync={"outer_momentum": 0.5})
    assert "every_steps > 1" in momentum["replica_sync.outer_momentum"][0]
    assert "unknown" in refused(replicas=2, replica_sync={"every": 4})["replica_sync.every"][0]
    assert "object" in refused(replicas=2, replica_sync=16)["replica_sync"][0]
    assert api.post("/api/jobs", {**DIGITS_JOB, "replicas": 2}, format="json").json()["replica_sync"] == {
        "every_steps": 1
    }

    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(6)]
    created = api.post(
        "/api/jobs", {**DIGITS_JOB, "replicas": 2, "replica_sync": {"every_steps": 8, "outer_lr": 0.5}}, format="json"
    ).json()
    assert created["replica_sync"] == {"every_steps": 8, "outer_lr": 0.5, "outer_momentum": 0.9}
    job = job_start(job=Job.objects.get(pk=created["id"]))
    reconcile_once()
    assert Stage.objects.filter(job=job).count() == 6
    syncs = {
        (a.stage_index, a.replica, a.replica_sync.every_steps, a.replica_sync.outer_lr)
        for node in nodes for a in map(Assignment.from_json, assignments_for_node(node=node))
    }
    assert syncs == {(i, r, 8, 0.5) for i in range(3) for r in range(2)}
    assert api.get(f"/api/jobs/{job.id}").json()["replica_sync"]["every_steps"] == 8


def test_a_lost_replica_is_replaced_at_the_same_generation_and_the_api_lists_replicas(
    api, ready_node, django_capture_on_commit_callbacks
) -> None:
    start = timezone.now() - timedelta(seconds=30)
    nodes = [ready_node(f"n{i}", port=50051 + i, now=start) for i in range(6)]
    created = api.post("/api/jobs", {**DIGITS_JOB, "replicas": 2}, format="json").json()
    job = job_start(job=Job.objects.get(pk=created["id"]))
    reconcile_once(now=start)
    job.refresh_from_db()
    rows = list(Stage.objects.filter(job=job).order_by("index", "replica"))
    assert [(s.index, s.replica) for s in rows] == [(i, r) for i in range(3) for r in range(2)]
    assert len({s.node_id for s in rows}) == 6 and job.next_replica == 2

    # each replica's assignment: its replica id, the siblings' credential, neighbours named step by step
    by_id = {str(n.id): n for n in nodes}
    middle = Assignment.from_json(assignments_for_node(node=by_id[str(rows[2].node_id)])[0])
    assert (middle.stage_id, middle.replica) == (f"{job.id}-stage-1-replica-0", 0)
    assert middle.prev_address is None and middle.next_address is None and middle.checkpoint is None
    assert "sibling" in middle.credentials.accepts
    # the replicas of a stage share its bearer token; each holds its own replica token, which the driver derives
    sibling = Assignment.from_json(assignments_for_node(node=by_id[str(rows[3].node_id)])[0])
    driver = job_driver_token(job_id=str(job.id), generation=job.generation)
    assert sibling.credentials.token == middle.credentials.token
    assert (middle.credentials.replica_token, sibling.credentials.replica_token) == (
        replica_token(driver, 1, 0), replica_token(driver, 1, 1))

    # running; the driver's plan names every replica, each stage served by its lowest
    generation = job.generation
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="d",
                                         driver_lease_expires_at=timezone.now() + timedelta(seconds=60))
    plan = train_plan(Job.objects.get(pk=job.pk), lease_owner="d")
    assert [(e.index, e.replica) for e in plan.replicas] == [(i, r) for i in range(3) for r in range(2)]
    assert [e.replica for e in plan.stages] == [0, 0, 0] and plan.replica_joins() == ()
    assert plan.replica_placed() == {(i, r) for i in range(3) for r in range(2)}

    # stage 1 replica 1's node goes silent; a spare registers
    now = timezone.now()
    lost = rows[3]
    for node in nodes:
        if node.id != lost.node_id:
            node_heartbeat(node=node, observed=[], now=now)
    spare = ready_node("spare", port=50061, now=now)
    report = reconcile_once(now=now)
    assert [type(a).__name__ for a in report.applied] == ["MarkNodeUnknown", "DropReplicas"]
    assert plan.replica_placed() == {(i, r) for i in range(3) for r in range(2)} - {(1, 1)}
    report = reconcile_once(now=now)
    assert [type(a).__name__ for a in report.applied] == ["AddReplicas"]
    job.refresh_from_db()
    assert job.generation == generation and job.status == "running" and job.restarts == 0
    joiner = Stage.objects.get(job=job, index=1, replica=2)
    assert joiner.node_id == spare.id and joiner.joining and joiner.generation == generation
    assert still_copying(job, now) == {(1, 0, 2)}  # the reconciler sees it holds none of the stage's state yet
    assignment = Assignment.from_json(assignments_for_node(node=spare)[0])
    assert assignment.replica == 2 and assignment.checkpoint is None  # it copies its state from a peer

    # the driver offers it to the roster once its agent reports it ready
    assert plan.replica_joins() == ()
    Stage.objects.filter(pk=joiner.pk).update(observed_generation=generation, observed_state="ready")
    [offered] = plan.replica_joins()
    assert (offered.index, offered.replica, offered.node_id) == (1, 2, str(spare.id))

    detail = api.get(f"/api/jobs/{job.id}").json()
    replicas = [(p["stage_index"], p["replica"], p["node_name"], p["joining"]) for p in detail["placements"]]
    assert (1, 2, "spare", True) in replicas and len(replicas) == 6
    assert all("micro_batches" in p and "state" in p for p in detail["placements"])
    assert all(p["joined"] is None for p in detail["placements"])

    # once it copied a live replica's state, the driver records what it copied on its row; a driver that lost the
    # lease records nothing
    copied = ReplicaJoin(1, 2, source_replica=0, size_bytes=4096, sha256="a" * 64, state_sha256="a" * 64)
    train_plan(Job.objects.get(pk=job.pk), lease_owner="another").replica_joined(replace(copied, size_bytes=1))
    assert Stage.objects.get(pk=joiner.pk).joined is None
    plan.replica_joined(copied)
    detail = api.get(f"/api/jobs/{job.id}").json()
    joined = {(p["stage_index"], p["replica"]): p["joined"] for p in detail["placements"]}
    assert joined.pop((1, 2)) == {"from_replica": 0, "size_bytes": 4096, "sha256": "a" * 64, "state_sha256": "a" * 64}
    assert set(joined.values()) == {None}
    assert still_copying(job, now) == set()
    assert reconcile_once(now=now).applied == []  # at its max: steady


def still_copying(job: Job, now: datetime) -> set[tuple[int, int, int]]:
    """The rows of `job` the reconciler's snapshot sees as joiners that have not copied their stage's state yet."""
    [view] = [j for j in load_snapshot(now)[0].jobs if j.id == str(job.id)]
    return {s.key for s in view.stages if s.joining}


def test_a_replica_lost_within_its_nodes_lease_is_replaced_on_a_spare_not_on_that_node(api, ready_node) -> None:
    """The job's tolerance for a silent node (2 s) drops a replica while its node's lease (6 s) still holds: the node
    looks Ready and free, the fastest too, but the drop is on record (its contribution's `released_at`), so the new
    replica goes to the spare at the next pass, and not to the node until it heartbeats again."""
    now = timezone.now()
    nodes = [ready_node(f"n{i}", port=50051 + i, now=now - timedelta(seconds=3)) for i in range(6)]
    created = api.post("/api/jobs", {**DIGITS_JOB, "replicas": 2, "node_grace_seconds": 2.0}, format="json").json()
    job = job_start(job=Job.objects.get(pk=created["id"]))
    reconcile_once(now=now - timedelta(seconds=3))
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="d",
                                         driver_lease_expires_at=now + timedelta(seconds=60))
    lost = Stage.objects.get(job=job, index=1, replica=1)
    for node in nodes:
        if node.id != lost.node_id:
            node_heartbeat(node=node, observed=[], now=now)
    spare = ready_node("spare", port=50061, flops=5e8, now=now)  # slower than the lost replica's node
    assert [type(a).__name__ for a in reconcile_once(now=now).applied] == ["DropReplicas"]  # no lease ran out
    assert StageContribution.objects.get(job=job, node_id=lost.node_id).released_at == now
    [grow] = reconcile_once(now=now).applied
    assert [(s.index, s.replica, s.node_id) for s in grow.stages] == [(1, 2, str(spare.id))]


def test_a_running_elastic_job_gains_replicas_as_nodes_register_without_a_restart(api, ready_node) -> None:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    created = api.post("/api/jobs", {**DIGITS_JOB, "replicas": {"min": 1, "max": 3}}, format="json").json()
    job = job_start(job=Job.objects.get(pk=created["id"]))
    reconcile_once()
    job.refresh_from_db()
    assert sorted(Stage.objects.filter(job=job).values_list("index", "replica")) == [(0, 0), (1, 0), (2, 0)]
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="d",
                                         driver_lease_expires_at=timezone.now() + timedelta(seconds=60))
    generation = job.generation
    assert reconcile_once().applied == []  # no free node: nothing to add
    ready_node("late-0", port=50061)
    ready_node("late-1", port=50062)
    added = [a for _ in range(3) for a in reconcile_once().applied]
    assert {type(a).__name__ for a in added} == {"AddReplicas"}
    job.refresh_from_db()
    assert (job.status, job.generation, job.restarts) == ("running", generation, 0)
    joiners = Stage.objects.filter(job=job, joining=True)
    assert joiners.count() == 2 and {s.node.name for s in joiners} == {"late-0", "late-1"}
    assert len(set(joiners.values_list("replica", flat=True))) == 2 and job.next_replica == 3


def test_a_succeeded_replicated_job_is_served_one_node_per_stage(api, ready_node) -> None:
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(6)]
    created = api.post("/api/jobs", {**DIGITS_JOB, "replicas": 2}, format="json").json()
    job = job_start(job=Job.objects.get(pk=created["id"]))
    reconcile_once()
    job.refresh_from_db()
    Job.objects.filter(pk=job.pk).update(status="succeeded", serving=True, generation=job.generation + 1)
    Stage.objects.filter(job=job).update(active=False)
    job.refresh_from_db()
    stages = tuple(PlannedStage(i, i, i + 1, str(nodes[i].id)) for i in range(3))
    assert job_serve_place(ServeJob(str(job.id), job.generation, stages, ()), timezone.now())
    served = Stage.objects.filter(job=job, active=True).order_by("index")
    assert [(s.index, s.replica, s.node_id) for s in served] == [(i, 0, nodes[i].id) for i in range(3)]
    [assignment] = [Assignment.from_json(a) for a in assignments_for_node(node=nodes[1])]
    assert assignment.inference and assignment.replica is None and assignment.stage_id == f"{job.id}-stage-1"


def test_a_rewind_moves_only_the_replica_it_names_and_its_sibling_keeps_its_node(api, ready_node) -> None:
    """A move planned for one replica (the only one left of its stage when the pass looked, or one its node failed)
    re-places that row alone: a sibling of the same stage rank, added since at the same generation, stays put."""
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(6)]
    created = api.post("/api/jobs", {**DIGITS_JOB, "replicas": 2}, format="json").json()
    job = job_start(job=Job.objects.get(pk=created["id"]))
    reconcile_once()
    job.refresh_from_db()
    before = {(s.index, s.replica): str(s.node_id) for s in Stage.objects.filter(job=job, active=True)}
    assert len(before) == 6 and {str(n.id) for n in nodes} == set(before.values())
    Stage.objects.filter(job=job).update(step_samples_per_second=100.0, step_compute_seconds=0.5)  # measured
    spare = ready_node("spare", port=50060)
    moved = RewindJob(str(job.id), job.generation, "placing", ((1, 0, 1, str(spare.id)),), True, "StageFailed", "t")
    assert execute([moved], now=timezone.now()).applied == [moved]
    job.refresh_from_db()
    after = {(s.index, s.replica): str(s.node_id) for s in Stage.objects.filter(job=job, active=True)}
    assert after == {**before, (1, 1): str(spare.id)} and job.status == "placing" and job.restarts == 1
    # the next driver routes each replica by the speed its node measured; the moved one's node measured nothing yet
    speeds = {(e.index, e.replica): e.samples_per_second for e in train_plan(job).replicas}
    assert speeds == {**{key: 100.0 for key in before}, (1, 1): None}
    assert Stage.objects.get(job=job, index=1, replica=1).step_compute_seconds is None
