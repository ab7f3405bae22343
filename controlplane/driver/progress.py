"""What the training driver records: steps, epochs, the stages' work counters (as contributions and
priced ledger entries), and the end.

Every write is guarded by the driver lease (`controlplane.jobs.leases`), so a driver that lost its
lease, or whose job was cancelled, learns it from a False return and stops; each write renews the lease.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from arceus.contracts.counters import StageCounters
from arceus.contracts.status import JobStatus
from arceus.training.plan import ReplicaFence, ReplicaJoin, StageTiming
from controlplane.common.dispatch import reconcile_soon
from controlplane.driver.recording import (
    COUNTER_FIELDS,
    JOB_FIELDS,
    ProgressReport,
    StepPoint,
    finite,
    jobs_record_counters,
    jobs_record_progress,
)
from controlplane.jobs.leases import held, renewed, stages_unfence
from controlplane.jobs.models import EpochMetric, Job, Stage, StageContribution


def job_record_steps(
    *,
    job_id: Any,
    lease_owner: str,
    points: Sequence[StepPoint],
    now: datetime,
    stages: Sequence[StageCounters] = (),
    timings: Sequence[StageTiming] = (),
) -> bool:
    """Record a batch of training steps (the newest becomes the job's progress), the stages' latest
    counters (as contributions and priced ledger entries) and their time per step (computing and waiting, and the
    speed of each hosting node it gives), and renew the lease; with no points it only renews. False if the caller
    no longer holds the lease. One job's report of `jobs_record_progress`."""
    report = ProgressReport(job_id=job_id, lease_owner=lease_owner, points=points, stages=stages, timings=timings)
    return jobs_record_progress(reports=[report], now=now)[0] is not None


def stage_timings_mean(steps: Sequence[Sequence[StageTiming]]) -> list[StageTiming]:
    """Each stage's (each replica's) mean time, samples and micro-batches per step over `steps` (each step's
    timings, one per stage or replica); a replica is averaged over the steps it took part in."""
    by_key: dict[tuple[int, str], list[StageTiming]] = {}
    for step in steps:
        for t in step:
            by_key.setdefault((t.index, t.node_id), []).append(t)
    return [
        StageTiming(
            index,
            sum(t.compute_seconds for t in ts) / len(ts),
            sum(t.wait_seconds for t in ts) / len(ts),
            sum(t.wall_seconds for t in ts) / len(ts),
            node_id=node_id,
            samples=sum(t.samples for t in ts) / len(ts),
            micro_batches=sum(t.micro_batches for t in ts) / len(ts),
        )
        for (index, node_id), ts in sorted(by_key.items())
    ]


@transaction.atomic
def job_record_epoch(
    *,
    job_id: Any,
    lease_owner: str,
    epoch: int,
    val_loss: float,
    val_accuracy: float,
    stages: Sequence[StageCounters],
    now: datetime,
) -> bool:
    """Record an epoch's validation and the stages' cumulative counters; False without the lease."""
    recorded = held(job_id, lease_owner).update(
        val_loss=finite(val_loss),
        val_accuracy=finite(val_accuracy),
        **renewed(now),
    )
    if not recorded:
        return False
    EpochMetric.objects.update_or_create(
        job_id=job_id,
        epoch=epoch,
        defaults={"val_loss": finite(val_loss), "val_accuracy": finite(val_accuracy)},
    )
    _record_counters(job_id, stages, now)
    return True


@transaction.atomic
def stage_record_joined(
    *, job_id: Any, lease_owner: str, generation: int, join: ReplicaJoin, now: datetime
) -> bool:
    """Record, on its placement row, that a joining replica copied its stage's state from a live replica (the
    driver's word: bytes and digests); a fenced one (`stage_record_fenced`) trains again, its node paid from `now`.
    False without the lease."""
    if not held(job_id, lease_owner).filter(generation=generation).exists():
        return False
    row = Stage.objects.filter(
        job_id=job_id, index=join.index, replica=join.replica, generation=generation, active=True
    )
    stages_unfence(row, now)
    row.update(joined={"from_replica": join.source_replica, "size_bytes": join.size_bytes, "sha256": join.sha256,
                       "state_sha256": join.state_sha256})
    return True


@transaction.atomic
def stage_record_fenced(
    *, job_id: Any, lease_owner: str, generation: int, fence: ReplicaFence, now: datetime
) -> bool:
    """Record, on its placement row, that the driver fenced a live replica (it takes no micro-batch until it joins
    again, at step `fence.until_step` at the earliest): the job shows it fenced, its node's time is billed only up to
    `now` until it rejoins (`stage_record_joined`), and the fence is counted in its window (`fences_counted`: the
    reconciler drops a replica fenced too often). False without the lease."""
    if not held(job_id, lease_owner).filter(generation=generation).exists():
        return False
    row = Stage.objects.select_for_update().filter(
        job_id=job_id, index=fence.index, replica=fence.replica, generation=generation, active=True
    ).first()
    if row is not None:
        row.fences, row.fences_since_step = fences_counted(
            row.fences, row.fences_since_step, fence.step, settings.ARCEUS_REPLICA_FENCE_WINDOW_STEPS
        )
        row.fenced_until_step, row.fenced_at = fence.until_step, now
        row.save(update_fields=["fences", "fences_since_step", "fenced_until_step", "fenced_at"])
        reconcile_soon()  # the rules may drop it now
    return True


def fences_counted(fences: int, since_step: int | None, step: int, window_steps: int) -> tuple[int, int]:
    """A replica's fences and the train step its window opened at, after one more fence in train step `step`: a
    window spans `window_steps` steps from its first fence; a fence outside it (later, or earlier: the job went back
    to a checkpoint) opens a new one."""
    if since_step is None or not since_step <= step < since_step + window_steps:
        return 1, step
    return fences + 1, since_step


@transaction.atomic
def job_finish(
    *,
    job_id: Any,
    lease_owner: str,
    final_loss: float,
    val_loss: float,
    val_accuracy: float,
    stages: Sequence[StageCounters],
    now: datetime,
) -> bool:
    """Record the end of training (final metrics and counters) and that the driver trained the job to the end,
    from which the reconciler marks it succeeded and releases its nodes; False if the caller no longer holds the
    lease."""
    job = held(job_id, lease_owner).select_for_update().first()
    if job is None:
        return False
    accuracy = finite(val_accuracy)
    summary = f"trained {job.step} steps" + (f", val accuracy {accuracy:.4f}" if accuracy is not None else "")
    job.final_loss, job.val_loss, job.val_accuracy = finite(final_loss), finite(val_loss), accuracy
    job.save(update_fields=["final_loss", "val_loss", "val_accuracy"])
    _record_counters(job_id, stages, now)
    _record_outcome(job, JobStatus.SUCCEEDED, "Completed", summary)
    return True


@transaction.atomic
def job_record_failure(*, job_id: Any, lease_owner: str, reason: str, message: str) -> bool:
    """Record that the driver cannot train the job (an invalid spec, a crash of its own), from which the
    reconciler fails it; False if the caller no longer holds the lease."""
    job = held(job_id, lease_owner).select_for_update().first()
    if job is None:
        return False
    _record_outcome(job, JobStatus.FAILED, reason, message)
    return True


def _record_outcome(job: Job, status: JobStatus, reason: str, message: str) -> None:
    """The driver's last word on the locked job, at its generation: a fact for the reconciler's rules."""
    job.driver_outcome, job.driver_outcome_reason, job.driver_outcome_message = status, reason, message
    job.driver_outcome_generation = job.generation
    job.save(update_fields=[
        "driver_outcome", "driver_outcome_reason", "driver_outcome_message", "driver_outcome_generation"
    ])
    reconcile_soon()


def contributions_release(
    *, rows: Sequence[Stage], now: datetime, fenced_out: Collection[tuple[int, int]] = ()
) -> None:
    """Replicas' rows about to be deleted while their job runs (`DropReplicas`): each node's contribution for the
    generation keeps what billing them needs (the counters written so far, when the node began to hold the replica and
    that it held it until `now`), so counters the driver measured before the loss and writes after it are billed;
    and whether it was dropped for its fences (`fenced_out`: (index, replica) of those), which keeps the job's
    replicas off its node for a while."""
    StageContribution.objects.bulk_create(
        [
            StageContribution(
                job_id=s.job_id, stage_index=s.index, generation=s.generation, node_id=s.node_id,
                held_since=s.held_since, released_at=now, fenced_out=(s.index, s.replica) in fenced_out,
                **{name: getattr(s, name) for name in COUNTER_FIELDS},
            )
            for s in rows
            if s.node_id is not None
        ],
        update_conflicts=True,
        unique_fields=["job", "stage_index", "generation", "node"],
        update_fields=["held_since", "released_at", "fenced_out", "updated_at"],
    )


def _record_counters(job_id: Any, stages: Sequence[StageCounters], now: datetime) -> None:
    """Store the stages' counters as a progress report does (`jobs_record_counters`); called by the lease holder."""
    if stages:
        jobs_record_counters(jobs=[Job.objects.only(*JOB_FIELDS).get(pk=job_id)], stages=[stages], now=now)
