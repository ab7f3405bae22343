"""Many jobs' progress recorded in one batch (`jobs_record_progress`) records exactly what one report at a time does:
the same rows, ledger entries and amounts, node speeds; and its queries do not grow with the jobs in it. The
drivers of one process that flush together are written as one batch (`ProgressRecorder`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import Sum
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from arceus.contracts.counters import StageCounters
from arceus.training.plan import StageTiming
from controlplane.controller.actions import DropReplicas
from controlplane.controller.executor import reconcile_once
from controlplane.controller.transitions import job_replicas_drop
from controlplane.driver.progress import job_record_steps
from controlplane.driver.recording import (
    ProgressRecorder,
    ProgressReport,
    Recorded,
    StepPoint,
    jobs_record_progress,
)
from controlplane.jobs.models import Job, LossPoint, Stage, StageContribution
from controlplane.market.models import LedgerEntry, PriceChange
from controlplane.nodes.device_class import node_device_class
from controlplane.nodes.models import Node

pytestmark = pytest.mark.django_db

DRIVER = "d"
CAP_MICROS = 40  # the capped job's max_total_usd: reached at its first report


@pytest.fixture
def fleet(ready_node, queued_job) -> dict[str, Job]:  # noqa: ANN001
    """Running jobs under the lease of DRIVER: a plain one, one with a cap, one of 3 stages x 2 replicas that lost a
    replica since it was placed, and one whose lease another driver holds; first, a job of one stage placed since on
    the lost replica's node (its reports measure the node that the replicated job's reports bill for the drop)."""
    start = timezone.now() - timedelta(seconds=60)
    for i in range(15):
        ready_node(f"n{i}", port=50051 + i, now=start, flops=1e11)  # a standard device until measured
    # a posted price above the base one, so that amounts are whole micro-dollars many times over
    PriceChange.objects.create(
        device_class=node_device_class(Node.objects.first()), price_per_hour=3.6, demand=1, supply=1
    )
    jobs = {
        "plain": queued_job(),
        "capped": queued_job(),
        "replicated": queued_job(replicas={"min": 2, "max": 2}),
        "taken": queued_job(),
    }
    for _ in jobs:
        reconcile_once(now=start)
    Stage.objects.filter(job__in=jobs.values()).update(held_since=start)
    replicated = Job.objects.get(pk=jobs["replicated"].pk)
    assert job_replicas_drop(
        DropReplicas(replicated.id, replicated.generation, replicated.status, ((1, 1),), ()),
        start + timedelta(seconds=30),
    )
    Job.objects.filter(pk=replicated.pk).update(replicas_min=1, replicas_max=1)  # not replaced: the node is free
    jobs = {"late": queued_job(stages=1), **jobs}
    reconcile_once(now=start)  # the nodes heartbeat at `start`
    [gone] = StageContribution.objects.filter(job=replicated, released_at__isnull=False).values_list("node", flat=True)
    assert Stage.objects.get(job=jobs["late"]).node_id == gone
    Stage.objects.filter(job=jobs["late"]).update(held_since=start + timedelta(seconds=40))
    Job.objects.filter(pk__in=[j.pk for j in jobs.values()]).update(
        status="running", driver_lease_owner=DRIVER, driver_lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    Job.objects.filter(pk=jobs["taken"].pk).update(driver_lease_owner="another driver")
    # capped once placed (placement would not start a job its cap cannot pay for)
    Job.objects.filter(pk=jobs["capped"].pk).update(requirements={"max_total_usd": CAP_MICROS / 1e6})
    return jobs


def reports(jobs: dict[str, Job], dropped: dict[int, str], n: int) -> list[ProgressReport]:
    """Each job's n-th report: one step, cumulative counters (the replicated job's per replica, the dropped one's
    included), time per step with the step's wall time."""
    out = []
    for job in jobs.values():
        rows = list(Stage.objects.filter(job=job, active=True).order_by("index", "replica"))
        replicated = job.stages.filter(replica__gt=0).exists()
        stages = [
            StageCounters(
                s.index, 32 * n, 4 * n, 0.02 * n, 1000 * n, 1000 * n, node_id=str(s.node_id) if replicated else ""
            )
            for s in rows
        ]
        timings = [
            StageTiming(
                s.index,
                0.02,
                0.01 * n,
                0.1,
                node_id=str(s.node_id) if replicated else "",
                samples=16 if replicated else 32,
                micro_batches=2 if replicated else 4,
            )
            for s in rows
        ]
        if replicated:
            stages += [
                StageCounters(index, 32 * n, 4 * n, 0.02 * n, 0, 0, node_id=node) for index, node in dropped.items()
            ]
        out.append(
            ProgressReport(
                job_id=job.id,
                lease_owner=DRIVER,
                points=[StepPoint(1, n, 90, 2.0 / n, 320.0)],
                stages=stages,
                timings=timings,
            )
        )
    return out


def recorded(jobs: dict[str, Job]) -> dict[str, Any]:
    """What recording wrote, without the ids and creation times the database gives each row."""
    mine = {"job__in": list(jobs.values())}
    return {
        "jobs": sorted(
            Job.objects.filter(pk__in=[j.pk for j in jobs.values()]).values_list(
                "id", "step", "total_steps", "epoch", "last_loss", "samples_per_second", "driver_lease_expires_at",
                "step_grant",
            )
        ),
        "losses": sorted(
            LossPoint.objects.filter(**mine).values_list("job", "step", "epoch", "loss", "samples_per_second")
        ),
        "stages": sorted(
            Stage.objects.filter(**mine).values_list(
                "id",
                "samples",
                "micro_batches",
                "compute_seconds",
                "bytes_sent",
                "bytes_received",
                "step_compute_seconds",
                "step_wait_seconds",
                "step_micro_batches",
                "step_samples_per_second",
            )
        ),
        "contributions": sorted(
            StageContribution.objects.filter(**mine).values_list(
                "job",
                "stage_index",
                "generation",
                "node",
                "samples",
                "micro_batches",
                "compute_seconds",
                "bytes_sent",
                "bytes_received",
                "held_since",
                "released_at",
            )
        ),
        "ledger": sorted(
            LedgerEntry.objects.filter(**mine).values_list(
                "job",
                "node",
                "stage_index",
                "generation",
                "step",
                "samples_total",
                "samples",
                "micro_batches",
                "compute_seconds",
                "held_seconds",
                "held_until",
                "flops",
                "bytes_sent",
                "bytes_received",
                "device_class",
                "price_per_hour",
                "charge_micros",
                "fee_micros",
                "credit_micros",
                "withheld",
            )
        ),
        "speeds": sorted(Node.objects.values_list("id", "flops_measured", "flops_measured_at")),
    }


def recorded_by(
    record: Callable[[list[ProgressReport], datetime], list[bool]],
    jobs: dict[str, Job],
    dropped: dict[int, str],
    now: datetime,
) -> tuple[dict[str, Any], list[list[bool]]]:
    """Three rounds of reports recorded by `record`, what they wrote, and what each round returned; rolled back."""
    point = transaction.savepoint()
    held = [record(reports(jobs, dropped, n), now + timedelta(seconds=10 * n)) for n in (1, 2, 3)]
    out = recorded(jobs)
    transaction.savepoint_rollback(point)
    return out, held


def one_at_a_time(batch: list[ProgressReport], now: datetime) -> list[bool]:
    return [
        job_record_steps(
            job_id=r.job_id, lease_owner=r.lease_owner, points=r.points, stages=r.stages, timings=r.timings, now=now
        )
        for r in batch
    ]


def test_a_batch_records_what_each_report_alone_records(fleet: dict[str, Job]) -> None:
    gone = StageContribution.objects.get(job=fleet["replicated"], released_at__isnull=False)
    dropped, now = {gone.stage_index: str(gone.node_id)}, timezone.now()
    alone, held_alone = recorded_by(one_at_a_time, fleet, dropped, now)
    batched, held_batched = recorded_by(
        lambda batch, at: jobs_record_progress(reports=batch, now=at), fleet, dropped, now
    )

    held_batched = [[r is not None for r in held] for held in held_batched]
    assert held_alone == held_batched == [[True, True, True, True, False]] * 3
    assert batched == alone
    # What was compared is what billing needs: every hosting node (and the dropped replica's) has an entry per report,
    # the capped job is charged its cap and no more, the job another driver holds has nothing recorded.
    entries = [dict(zip(("job", "node", "charge"), (e[0], e[1], e[16]), strict=True)) for e in batched["ledger"]]
    by_job = {name: [e for e in entries if e["job"] == job.pk] for name, job in fleet.items()}
    assert [len(by_job[name]) for name in ("late", "plain", "capped", "replicated", "taken")] == [3, 9, 9, 18, 0]
    assert sum(e["charge"] for e in by_job["capped"]) == CAP_MICROS
    assert all(e["charge"] > 0 for e in by_job["plain"])
    # The dropped replica's node, measured by the late job's reports, is billed at the class they measured for the
    # replicated job's: the late job's report comes first, and its own first entry was priced before it measured.
    node = Node.objects.get(pk=gone.node_id)
    declared = node_device_class(node)
    node.flops_measured = next(speed for pk, speed, _ in batched["speeds"] if pk == node.pk)
    measured = node_device_class(node)
    on_node = sorted((e[4], e[0], e[14]) for e in batched["ledger"] if e[1] == node.pk)  # step, job, class
    assert [k for _, job, k in on_node if job == fleet["late"].pk] == [declared, measured, measured]
    assert [k for _, job, k in on_node if job == fleet["replicated"].pk] == [measured] * 3 != [declared] * 3
    assert not [row for row in batched["losses"] if row[0] == fleet["taken"].pk]
    assert {speed for _, speed, _ in batched["speeds"] if speed is not None}  # the steps' wall time measured them


def test_a_batch_makes_as_many_queries_for_many_jobs_as_for_one(ready_node, queued_job) -> None:  # noqa: ANN001
    for i in range(9):
        ready_node(f"n{i}", port=50051 + i)
    jobs = {str(i): queued_job() for i in range(3)}
    for _ in jobs:
        reconcile_once()
    Job.objects.filter(pk__in=[j.pk for j in jobs.values()]).update(
        status="running", driver_lease_owner=DRIVER, driver_lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    now = timezone.now()
    jobs_record_progress(reports=reports(jobs, {}, 1), now=now)  # the first ledger entries
    counts = []
    for n, batch in ((2, reports({"0": jobs["0"]}, {}, 2)), (3, reports(jobs, {}, 3))):
        with CaptureQueriesContext(connection) as queries:
            assert all(jobs_record_progress(reports=batch, now=now + timedelta(seconds=n)))
        counts.append(len(queries))
    # 3 reads, a price, 7 writes and the savepoint around them (the test's transaction holds the batch's)
    assert counts[0] == counts[1] <= 13
    # every job's 3 stages billed for the samples of their last report (jobs 1 and 2 skipped their second)
    assert LedgerEntry.objects.filter(job__in=jobs.values()).aggregate(s=Sum("samples"))["s"] == 3 * 3 * 32 * 3


def test_a_batch_holds_one_report_per_job_whatever_form_its_id_takes(fleet: dict[str, Job]) -> None:
    report = reports({"plain": fleet["plain"]}, {}, 1)[0]
    as_hex = replace(report, job_id=fleet["plain"].pk.hex)
    with pytest.raises(ValueError, match="one report per job"):
        jobs_record_progress(reports=[report, as_hex], now=timezone.now())
    assert jobs_record_progress(reports=[as_hex], now=timezone.now())[0] is not None
    assert Job.objects.get(pk=fleet["plain"].pk).step == 1


class Gated:
    """`jobs_record_progress`, whose first batch waits until the test opens the gate; the sizes of the batches."""

    def __init__(self) -> None:
        self.entered, self.gate, self.batches = threading.Event(), threading.Event(), []

    def __call__(self, *, reports: list[ProgressReport], now: datetime) -> list[Recorded | None]:
        if not self.batches:
            self.entered.set()
            self.gate.wait(10)
        self.batches.append([r.points[-1].step if r.points else None for r in reports])
        return jobs_record_progress(reports=reports, now=now)


def record_in_threads(recorder: ProgressRecorder, write: Gated, batch: list[ProgressReport]) -> list[Any]:
    """Each report recorded from a thread of its own, the threads started in order, each once the one before it
    queued its report (the first is writing its own batch, held at the gate); what each call returned or raised."""
    out: list[Any] = [None] * len(batch)

    def record(i: int) -> None:
        try:
            out[i] = recorder.record(batch[i])
        except Exception as exc:  # noqa: BLE001 (what the caller sees)
            out[i] = exc
        finally:
            connection.close()  # this thread's own

    threads = [threading.Thread(target=record, args=(i,)) for i in range(len(batch))]
    threads[0].start()
    assert write.entered.wait(10)
    for i, thread in enumerate(threads[1:], start=1):
        thread.start()
        deadline = time.monotonic() + 10
        while len(recorder._queued) < i and time.monotonic() < deadline:  # the first is writing, not queued
            time.sleep(0.005)
    write.gate.set()
    for thread in threads:
        thread.join(10)
    return out


@pytest.fixture
def running_jobs(ready_node, queued_job) -> list[Job]:  # noqa: ANN001
    """Three running jobs under DRIVER's lease, and one under another driver's."""
    for i in range(12):
        ready_node(f"n{i}", port=50051 + i)
    jobs = [queued_job() for _ in range(4)]
    for _ in jobs:
        reconcile_once()
    Job.objects.filter(pk__in=[j.pk for j in jobs]).update(
        status="running", driver_lease_owner=DRIVER, driver_lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    Job.objects.filter(pk=jobs[3].pk).update(driver_lease_owner="another driver")
    return jobs


def step(job: Job, n: int, loss: Any = 1.0) -> ProgressReport:
    return ProgressReport(job_id=str(job.id), lease_owner=DRIVER, points=[StepPoint(1, n, 90, loss, 320.0)])


@pytest.mark.django_db(transaction=True)  # the drivers' threads write through connections of their own
def test_drivers_that_flush_together_are_written_as_one_batch(running_jobs: list[Job]) -> None:
    write = Gated()
    recorder = ProgressRecorder(write)
    a, b, c, taken = running_jobs
    held = record_in_threads(recorder, write, [step(a, 1), step(b, 1), step(taken, 1), step(c, 1), step(b, 2)])

    # The first wrote alone; the rest queued while it wrote and went together, but for b's second report, which
    # waits for the batch after the one holding b's first.
    assert write.batches == [[1], [1, 1, 1], [2]]
    # Each caller learns whether it held its own job's lease (None where it did not), and its job's grant.
    assert [r is not None for r in held] == [True, True, False, True, True]
    steps = dict(Job.objects.filter(pk__in=[j.pk for j in running_jobs]).values_list("pk", "step"))
    assert [steps[j.pk] for j in running_jobs] == [1, 2, 1, 0]
    assert not recorder._queued and not recorder._writing


@pytest.mark.django_db(transaction=True)
def test_a_report_that_cannot_be_written_fails_only_its_own_caller(running_jobs: list[Job]) -> None:
    write = Gated()
    recorder = ProgressRecorder(write)
    a, b, c, _ = running_jobs
    held = record_in_threads(recorder, write, [step(a, 1), step(b, 1), step(c, 1, loss="not a number")])

    assert None not in held[:2]
    assert isinstance(held[2], TypeError)
    assert write.batches == [[1], [1, 1], [1], [1]]  # the failed batch, then each of its reports alone
    steps = dict(Job.objects.filter(pk__in=[j.pk for j in running_jobs]).values_list("pk", "step"))
    assert [steps[j.pk] for j in (a, b, c)] == [1, 1, 0]
