"""The driver's services: the lease, progress records, finishing; and how the job detail shows them."""

from __future__ import annotations

import math
import uuid
from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.db.models import Sum
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.counters import StageCounters
from arceus.swarm.routing import Routes
from arceus.training.plan import ReplicaFence, ReplicaJoin, StageTiming, StepProgress
from arceus.training.tally import WorkTally
from arceus.v1 import stage_pb2
from controlplane.controller.actions import DropReplicas
from controlplane.controller.executor import reconcile_once
from controlplane.controller.transitions import job_fail, job_replicas_drop, job_rewind
from controlplane.driver.progress import (
    StepPoint,
    job_finish,
    job_record_epoch,
    job_record_failure,
    job_record_steps,
    stage_record_fenced,
    stage_record_joined,
    stage_timings_mean,
)
from controlplane.driver.sink import DbProgressSink
from controlplane.jobs.leases import job_driver_claim
from controlplane.jobs.models import EpochMetric, Job, LossPoint, Stage, StageContribution
from controlplane.jobs.selectors import job_loss_curve
from controlplane.jobs.services import job_cancel
from controlplane.market.models import LedgerEntry

pytestmark = pytest.mark.django_db


def points(*losses: float, start: int = 1) -> list[StepPoint]:
    return [StepPoint(1, start + i, 90, loss, 100.0 + i) for i, loss in enumerate(losses)]


def test_one_driver_holds_the_lease_until_it_expires(running_job: Job) -> None:
    now = timezone.now()
    assert job_driver_claim(job_id=running_job.id, owner="a", now=now) is not None
    assert job_driver_claim(job_id=running_job.id, owner="b", now=now) is None
    later = now + timedelta(seconds=121)  # past ARCEUS_DRIVER_LEASE_SECONDS without a renewal
    taken = job_driver_claim(job_id=running_job.id, owner="b", now=later)
    assert taken is not None and taken.driver_lease_owner == "b"
    # The old driver finds out at its next write.
    assert job_record_steps(job_id=running_job.id, lease_owner="a", points=points(1.0), now=later) is False


def test_only_running_jobs_can_be_claimed(running_job: Job) -> None:
    job_cancel(job=running_job)
    assert job_driver_claim(job_id=running_job.id, owner="a", now=timezone.now()) is None


def test_steps_are_recorded_idempotently_and_renew_the_lease(running_job: Job) -> None:
    now = timezone.now()
    job_driver_claim(job_id=running_job.id, owner="a", now=now)
    later = now + timedelta(seconds=100)
    assert job_record_steps(job_id=running_job.id, lease_owner="a", points=points(2.0, 1.5), now=later)
    # A restarted driver replays step 2 with another value: upserted, not duplicated.
    assert job_record_steps(job_id=running_job.id, lease_owner="a", points=points(1.4, math.nan, start=2), now=later)
    job = Job.objects.get(pk=running_job.pk)
    assert (job.step, job.total_steps, job.epoch, job.last_loss) == (3, 90, 1, None)  # NaN is stored as null
    assert job.driver_lease_expires_at == later + timedelta(seconds=settings.ARCEUS_DRIVER_LEASE_SECONDS)
    assert list(LossPoint.objects.filter(job=job).values_list("step", "loss")) == [(1, 2.0), (2, 1.4), (3, None)]


def test_epochs_record_validation_and_stage_counters(running_job: Job) -> None:
    now = timezone.now()
    job_driver_claim(job_id=running_job.id, owner="a", now=now)
    counters = [StageCounters(i, 1000 * (i + 1), 40, 0.5, 2048, 1024) for i in range(3)]
    assert job_record_epoch(
        job_id=running_job.id, lease_owner="a", epoch=1, val_loss=0.4, val_accuracy=0.9, stages=counters, now=now
    )
    job = Job.objects.get(pk=running_job.pk)
    assert (job.val_loss, job.val_accuracy) == (0.4, 0.9)
    assert list(EpochMetric.objects.filter(job=job).values_list("epoch", "val_accuracy")) == [(1, 0.9)]
    assert list(Stage.objects.filter(job=job).order_by("index").values_list("samples", flat=True)) == [
        1000,
        2000,
        3000,
    ]


def test_finish_succeeds_the_job_and_frees_its_nodes(running_job: Job) -> None:
    now = timezone.now()
    job_driver_claim(job_id=running_job.id, owner="a", now=now)
    job_record_steps(job_id=running_job.id, lease_owner="a", points=points(2.0, 1.0), now=now)
    assert not job_finish(
        job_id=running_job.id, lease_owner="b", final_loss=1.0, val_loss=0.5, val_accuracy=0.9, stages=[], now=now
    )
    assert job_finish(
        job_id=running_job.id, lease_owner="a", final_loss=1.0, val_loss=0.5, val_accuracy=0.9, stages=[], now=now
    )
    reconcile_once(now=now)  # the pass the driver's last word nudged
    job = Job.objects.get(pk=running_job.pk)
    assert (job.status, job.final_loss, job.finished_at) == ("succeeded", 1.0, now)
    assert job.driver_lease_owner == "" and job.driver_lease_expires_at is None
    succeeded = next(c for c in job.conditions if c["type"] == "Succeeded")
    assert (succeeded["status"], succeeded["message"]) == ("True", "trained 2 steps, val accuracy 0.9000")
    assert not Stage.objects.filter(job=job, active=True).exists()


def test_a_cancelled_job_stops_its_driver(running_job: Job) -> None:
    now = timezone.now()
    job_driver_claim(job_id=running_job.id, owner="a", now=now)
    job_cancel(job=running_job)
    assert job_record_steps(job_id=running_job.id, lease_owner="a", points=[], now=now) is False
    assert not job_finish(
        job_id=running_job.id, lease_owner="a", final_loss=1.0, val_loss=0.5, val_accuracy=0.9, stages=[], now=now
    )
    assert Job.objects.get(pk=running_job.pk).status == "cancelled"


def test_the_detail_shows_progress_placements_and_curves(running_job: Job, api: APIClient) -> None:
    now = timezone.now()
    job_driver_claim(job_id=running_job.id, owner="a", now=now)
    timings = [StageTiming(i, 0.25, 0.0, 0.3, samples=32, micro_batches=4) for i in range(3)]
    job_record_steps(job_id=running_job.id, lease_owner="a", points=points(2.0, 1.0), timings=timings, now=now)
    counters = [StageCounters(i, 64, 8, 0.25, 4096, 2048) for i in range(3)]
    job_record_epoch(
        job_id=running_job.id, lease_owner="a", epoch=1, val_loss=0.7, val_accuracy=0.8, stages=counters, now=now
    )
    detail = api.get(f"/api/jobs/{running_job.id}").json()
    assert (detail["status"], detail["step"], detail["total_steps"], detail["last_loss"]) == ("running", 2, 90, 1.0)
    assert detail["samples_per_second"] == 101.0
    assert detail["loss_curve"] == [{"step": 1, "epoch": 1, "loss": 2.0}, {"step": 2, "epoch": 1, "loss": 1.0}]
    assert detail["epochs"] == [{"epoch": 1, "val_loss": 0.7, "val_accuracy": 0.8}]
    placement = detail["placements"][0]
    stage = Stage.objects.select_related("node").get(job=running_job, index=0)
    assert placement == {
        "stage_index": 0,
        "rank": 0,
        "replica": 0,
        "joining": False,
        "joined": None,
        "layer_start": 0,
        "layer_end": 1,
        "node_id": str(stage.node_id),
        "node_name": stage.node.name,
        "generation": running_job.generation,
        "state": "pending",
        "message": "",
        "samples": 64,
        "micro_batches": 8,
        "compute_seconds": 0.25,
        "bytes_sent": 4096,
        "bytes_received": 2048,
        "relayed": False,
        "activity": "pending",  # its agent has not reported it built
        "fenced_until_step": None,
        "fences": 0,
        "step_micro_batches": 4.0,
        "share": 1.0,  # a one-node stage takes every micro-batch
        "samples_per_second": 128.0,  # 32 samples in 0.25 s of compute
    }
    assert {c["type"] for c in detail["conditions"]} == {"Placed", "StagesReady"}


def test_a_long_loss_curve_is_thinned_keeping_the_newest_step(running_job: Job) -> None:
    now = timezone.now()
    job_driver_claim(job_id=running_job.id, owner="a", now=now)
    job_record_steps(job_id=running_job.id, lease_owner="a", points=points(*([1.0] * 25)), now=now)
    running_job.refresh_from_db()
    curve = job_loss_curve(job=running_job, max_points=10)
    assert [p["step"] for p in curve] == [3, 6, 9, 12, 15, 18, 21, 24, 25]
    assert len(job_loss_curve(job=running_job, max_points=100)) == 25


def test_a_driver_cannot_fail_a_job_it_no_longer_drives(running_job: Job) -> None:
    now = timezone.now()
    job_driver_claim(job_id=running_job.id, owner="a", now=now)
    assert not job_record_failure(job_id=running_job.id, lease_owner="b", reason="DriverError", message="boom")
    assert not job_fail(job_id=running_job.id, generation=running_job.generation - 1, reason="DriverError",
                        message="boom", now=now)
    reconcile_once(now=now)
    assert Job.objects.get(pk=running_job.pk).status == "running"
    assert job_record_failure(job_id=running_job.id, lease_owner="a", reason="DriverError", message="boom")
    reconcile_once(now=now)  # the pass the driver's last word nudged
    failed = Job.objects.get(pk=running_job.pk)
    assert (failed.status, failed.error) == ("failed", "boom")
    assert [(c["type"], c["status"], c["reason"]) for c in failed.conditions[-2:]] == [
        ("Training", "False", "DriverError"),
        ("Failed", "True", "DriverError"),
    ]


def test_steps_record_each_stages_time_computing_and_waiting(running_job: Job) -> None:
    now = timezone.now()
    job_driver_claim(job_id=running_job.id, owner="a", now=now)
    steps = [[StageTiming(i, 0.02 * (i + 1), 0.01 * k) for i in range(3)] for k in (1, 3)]
    timings = stage_timings_mean(steps)
    assert [(t.index, round(t.wait_seconds, 6)) for t in timings] == [(0, 0.02), (1, 0.02), (2, 0.02)]
    assert job_record_steps(job_id=running_job.id, lease_owner="a", points=points(1.0), timings=timings, now=now)
    rows = Stage.objects.filter(job=running_job).order_by("index")
    assert [(round(s.step_compute_seconds, 6), round(s.step_wait_seconds, 6)) for s in rows] == [
        (0.02, 0.02), (0.04, 0.02), (0.06, 0.02)
    ]
    assert [(s.step_micro_batches, s.step_samples_per_second) for s in rows] == [(None, None)] * 3  # not counted


def test_each_replica_is_billed_on_its_node_for_the_micro_batches_the_driver_routed_to_it(
    ready_node, queued_job
) -> None:
    """A job of 3 stages x 2 replicas: the driver's tally (arceus.training.tally) counts each replica's micro-batches
    as the routes gave them, and the ledger bills each replica's node for its own work and the time it held the
    device: one entry per replica, its micro-batches and samples those the job saw it process."""
    start = timezone.now() - timedelta(seconds=60)
    job, node_of = replicated_running_job(ready_node, queued_job, start)
    assert len(set(node_of.values())) == 6
    # Stage 1's replica 0 is faster: it takes 3 of the 4 micro-batches (8 samples each); the others share evenly.
    routes = Routes(((0, 1),) * 3, ((0, 0, 0), (1, 0, 1), (0, 0, 0), (1, 1, 1)))
    tally, now = WorkTally(), start + timedelta(seconds=60)  # not the clock: the set-up takes its own time
    for step in (1, 2):
        counters = []
        for (i, k), node in sorted(node_of.items()):
            routed = routes.micro_batches_of(i, k)
            counters.append(tally.record(index=i, node_id=node, samples=8 * len(routed), micro_batches=len(routed),
                                         wall_seconds=0.1, max_bytes=1 << 20, reported=stage_pb2.StageCounters()))
        assert job_record_steps(job_id=job.id, lease_owner="d", points=points(1.0, start=step), stages=counters,
                                now=now + timedelta(seconds=step))
    entries = {(e.stage_index, str(e.node_id)): e for e in LedgerEntry.objects.filter(job=job, reverses=None)
               .order_by("created_at")}
    expected = {(0, 0): 2, (0, 1): 2, (1, 0): 3, (1, 1): 1, (2, 0): 2, (2, 1): 2}  # micro-batches per step
    for (i, k), per_step in expected.items():
        rows = LedgerEntry.objects.filter(job=job, stage_index=i, node_id=node_of[(i, k)], reverses=None)
        assert sum(r.micro_batches for r in rows) == 2 * per_step, (i, k)
        assert sum(r.samples for r in rows) == 2 * 8 * per_step, (i, k)
        # Each replica's node is paid for the time it held the device: from placement to the second report.
        assert math.isclose(sum(r.held_seconds for r in rows), 62.0, abs_tol=1e-6) and rows[0].charge_micros > 0
    assert len(entries) == 6
    totals = LedgerEntry.objects.filter(job=job).aggregate(c=Sum("charge_micros"), f=Sum("fee_micros"),
                                                           k=Sum("credit_micros"))
    assert totals["k"] + totals["f"] == totals["c"] > 0


def test_a_replicated_stage_records_each_replicas_share_and_speed(ready_node, queued_job) -> None:
    """Each replica's timings are its own (by its node), averaged over the steps it took part in."""
    for i in range(5):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job(stages=1, replicas={"min": 2, "max": 3})
    reconcile_once()
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="",
                                         driver_lease_expires_at=now + timedelta(seconds=60))
    job_driver_claim(job_id=job.id, owner="a", now=now)
    a, b = (str(n) for n in Stage.objects.filter(job=job).order_by("replica").values_list("node_id", flat=True))
    gone = str(uuid.uuid4())  # a replica that joined for the second step and was dropped since: no row to write
    steps = [
        [StageTiming(0, 0.1, 0.0, 0.2, node_id=a, samples=16, micro_batches=2),
         StageTiming(0, 0.1, 0.0, 0.2, node_id=b, samples=16, micro_batches=2)],
        [StageTiming(0, 0.1, 0.0, 0.2, node_id=a, samples=8, micro_batches=1),
         StageTiming(0, 0.3, 0.0, 0.4, node_id=b, samples=24, micro_batches=3),
         StageTiming(0, 0.1, 0.0, 0.4, node_id=gone, samples=8, micro_batches=1)],
    ]
    timings = stage_timings_mean(steps)
    assert [(t.node_id, t.samples, t.micro_batches) for t in timings] == sorted(
        [(a, 12, 1.5), (b, 20, 2.5), (gone, 8, 1)])
    assert job_record_steps(job_id=job.id, lease_owner="a", points=points(1.0), timings=timings, now=now)
    rows = {str(s.node_id): s for s in Stage.objects.filter(job=job)}
    assert (rows[a].step_micro_batches, rows[b].step_micro_batches) == (1.5, 2.5)
    assert rows[a].step_samples_per_second == pytest.approx(12 / 0.1)
    assert rows[b].step_samples_per_second == pytest.approx(20 / 0.2)
    assert rows[b].step_compute_seconds == pytest.approx(0.2) and rows[a].step_compute_seconds == pytest.approx(0.1)


def replicated_running_job(ready_node, queued_job, start: datetime) -> tuple[Job, dict[tuple[int, int], str]]:
    """A job of 3 stages x 2 replicas placed at `start`, its driver lease held by "d"; the node of each replica."""
    for i in range(6):
        ready_node(f"n{i}", port=50051 + i, now=start)
    job = queued_job(replicas={"min": 2, "max": 2})
    reconcile_once(now=start)
    Stage.objects.filter(job=job).update(held_since=start)
    Job.objects.filter(pk=job.pk).update(
        status="running", driver_lease_owner="d", driver_lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    job.refresh_from_db()
    return job, {(s.index, s.replica): str(s.node_id) for s in Stage.objects.filter(job=job)}


def test_a_replica_dropped_before_its_first_counter_write_is_billed_for_what_the_driver_measured(
    ready_node, queued_job
) -> None:
    """We bill only what we measured: the driver counted a replica's finished steps before it was lost, and writes them
    after the control plane dropped its row. They are stored on its node's contribution and billed for the time it
    held its node until the drop, not after; counters naming a node that held no replica of the job add nothing."""
    start = timezone.now() - timedelta(seconds=60)
    job, node_of = replicated_running_job(ready_node, queued_job, start)
    dropped_at = start + timedelta(seconds=30)
    assert job_replicas_drop(DropReplicas(job.id, job.generation, job.status, ((1, 1),), ()), dropped_at)
    assert not Stage.objects.filter(job=job, index=1, replica=1).exists()
    stranger = str(uuid.uuid4())
    counters = [StageCounters(i, 16, 2, 0.1, 100, 100, node_id=node) for (i, _), node in sorted(node_of.items())]
    counters.append(StageCounters(1, 16, 2, 0.1, 100, 100, node_id=stranger))
    assert job_record_steps(job_id=job.id, lease_owner="d", points=points(1.0), stages=counters,
                            now=start + timedelta(seconds=40))

    lost = StageContribution.objects.get(job=job, stage_index=1, node_id=node_of[(1, 1)])
    assert (lost.samples, lost.micro_batches, lost.released_at) == (16, 2, dropped_at)
    [entry] = LedgerEntry.objects.filter(job=job, node_id=node_of[(1, 1)], reverses=None)
    assert (entry.micro_batches, entry.samples) == (2, 16) and entry.charge_micros > 0
    assert math.isclose(entry.held_seconds, 30.0, abs_tol=0.01)  # placement to drop: the seconds after it are not its
    assert entry.held_until == dropped_at
    live = LedgerEntry.objects.get(job=job, node_id=node_of[(1, 0)], reverses=None)
    assert math.isclose(live.held_seconds, 40.0, abs_tol=0.01)
    assert not StageContribution.objects.filter(job=job, node_id=stranger).exists()
    assert not LedgerEntry.objects.filter(job=job, node_id=stranger).exists()


def test_a_fenced_replica_is_billed_for_the_time_it_held_its_node_before_its_fence_and_after_its_rejoin(
    ready_node, queued_job
) -> None:
    """A live replica the driver fences keeps its node (the control plane still places it) but trains no more until it
    joins again: its work measured before the fence and written after it is billed up to the fence, and once it has
    rejoined, its node is paid from the rejoin, never for the fenced seconds between."""
    start = timezone.now() - timedelta(seconds=60)
    job, node_of = replicated_running_job(ready_node, queued_job, start)
    assert stage_record_fenced(job_id=job.id, lease_owner="d", generation=job.generation,
                               fence=ReplicaFence(1, 1, 4, 3), now=start + timedelta(seconds=20))
    assert not stage_record_fenced(job_id=job.id, lease_owner="other", generation=job.generation,
                                   fence=ReplicaFence(1, 0, 4, 3), now=start)  # without the lease, nothing
    row = Stage.objects.get(job=job, index=1, replica=1)
    assert (row.fenced_until_step, row.fenced_at) == (4, start + timedelta(seconds=20))
    assert Stage.objects.filter(job=job, fenced_at__isnull=False).count() == 1

    def report(samples: int, at: float) -> LedgerEntry:
        counters = [StageCounters(i, samples, samples // 8, 0.1, 100, 100, node_id=node)
                    for (i, _), node in sorted(node_of.items())]
        assert job_record_steps(job_id=job.id, lease_owner="d", points=points(1.0), stages=counters,
                                now=start + timedelta(seconds=at))
        return LedgerEntry.objects.filter(job=job, node_id=node_of[(1, 1)], reverses=None).latest("created_at")

    before = report(16, 30)  # what it did before its fence
    assert (before.samples, before.held_until) == (16, start + timedelta(seconds=20))
    assert math.isclose(before.held_seconds, 20.0, abs_tol=0.01)
    assert stage_record_joined(job_id=job.id, lease_owner="d", generation=job.generation,
                               join=ReplicaJoin(1, 1, 0, 10, "a", "a"), now=start + timedelta(seconds=40))
    row.refresh_from_db()
    assert (row.fenced_until_step, row.fenced_at, row.held_since) == (None, None, start + timedelta(seconds=40))
    after = report(32, 50)
    assert after.samples == 16 and math.isclose(after.held_seconds, 10.0, abs_tol=0.01)  # rejoin to report
    sibling = LedgerEntry.objects.filter(job=job, node_id=node_of[(1, 0)], reverses=None)
    assert math.isclose(sum(e.held_seconds for e in sibling), 50.0, abs_tol=0.01)
    # A driver that takes the lease over, and a rewind, start with no replica fenced.
    assert stage_record_fenced(job_id=job.id, lease_owner="d", generation=job.generation,
                               fence=ReplicaFence(1, 1, 9, 5), now=start + timedelta(seconds=55))
    later = timezone.now() + timedelta(seconds=120)  # the lease of "d" expired
    assert job_driver_claim(job_id=job.id, owner="e", now=later)
    row.refresh_from_db()
    assert (row.fenced_until_step, row.fenced_at, row.held_since) == (None, None, later)
    assert stage_record_fenced(job_id=job.id, lease_owner="e", generation=job.generation,
                               fence=ReplicaFence(1, 1, 9, 5), now=later)
    assert job_rewind(job_id=job.id, generation=job.generation, reason="DriverLost", message="test", now=later)
    assert not Stage.objects.filter(job=job, fenced_until_step__isnull=False).exists()


def test_the_driver_writes_a_replica_that_left_since_its_last_step_with_the_others(
    ready_node, queued_job
) -> None:
    """The sink writes every agent's newest counters since its last write, not only the newest step's: a replica lost
    after a step that no write covered is billed for that step."""
    job, node_of = replicated_running_job(ready_node, queued_job, timezone.now() - timedelta(seconds=60))
    sink = DbProgressSink(job_id=str(job.id), lease_owner="d", generation=job.generation, flush_seconds=3600.0)
    everyone = {key: StageCounters(key[0], 16, 2, 0.1, 100, 100, node_id=node) for key, node in node_of.items()}
    survivors = [replace(c, samples=48, micro_batches=6) for key, c in everyone.items() if key != (1, 1)]
    sink.flush()  # a driver's first report: the job's grant known, far enough ahead that neither step is written
    for step, stages in ((1, list(everyone.values())), (2, survivors)):
        sink.on_step(StepProgress(epoch=1, step=step, total_steps=90, loss=1.0, samples_per_second=1.0, seconds=0.1,
                                  stages=stages))
    sink.flush()
    written = {(c.stage_index, str(c.node_id)): c.micro_batches for c in StageContribution.objects.filter(job=job)}
    assert written == {(i, node): 2 if (i, k) == (1, 1) else 6 for (i, k), node in node_of.items()}
