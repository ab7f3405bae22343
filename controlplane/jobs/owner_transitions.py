"""The job status transitions its owner causes directly: queue (start) and cancel, and a job's end, which the
cancel shares with the controller's succeed and fail (`controlplane/controller/transitions.py`). The owner's
services call these; like the controller's, each nudges the reconciler when it changes a placement."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from arceus.contracts.status import TERMINAL_STATUSES, JobStatus
from controlplane.common.conditions import FALSE, Condition, set_conditions
from controlplane.common.dispatch import reconcile_soon
from controlplane.common.errors import ApplicationError
from controlplane.jobs.checkpoints import checkpoint_uploads_withdraw, checkpoints_delete
from controlplane.jobs.models import Job, Stage


def job_queue(*, job: Job, epochs: int | None, learning_rate: float | None, now: datetime) -> Job:
    """Queue a locked, startable job for placement, dropping the previous attempt's placement, progress
    and checkpoints: starting again trains from scratch."""
    job.stages.all().delete()
    job.loss_points.all().delete()
    job.epoch_metrics.all().delete()
    job.resume_checkpoint = None
    checkpoints_delete(job.checkpoints.all())
    job.restarts = 0
    if epochs is not None:
        job.epochs = epochs
    if learning_rate is not None:
        job.learning_rate = learning_rate
    job.status = JobStatus.QUEUED
    job.generation += 1
    job.conditions = set_conditions(
        [], Condition("Placed", FALSE, "Queued", "waiting for the reconciler to place the stages"), now=now
    )
    job.step, job.total_steps, job.epoch, job.step_grant = 0, None, 0, None
    job.last_loss = job.final_loss = job.val_loss = job.val_accuracy = job.samples_per_second = None
    job.error = ""
    job.driver_lease_owner, job.driver_lease_expires_at = "", None
    job.started_at, job.finished_at = None, None
    job.save()
    reconcile_soon()
    return job


@transaction.atomic
def job_cancel(*, job: Job, now: datetime, by: str = "its owner") -> Job:
    """Stop the job: agents drop its stages at their next heartbeat and its driver stops at its next
    progress write. `by`: who cancelled it, for the job's Training condition."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.status in TERMINAL_STATUSES:
        raise ApplicationError.conflict(f"job {job.id} already {job.status}; there is nothing to cancel")
    job_end(job, JobStatus.CANCELLED, Condition("Training", FALSE, "Cancelled", f"cancelled by {by}"), now=now)
    return job


def job_end(job: Job, status: JobStatus, *conditions: Condition, now: datetime) -> None:
    """Move a locked job to a terminal status and release its nodes (a placement change)."""
    job.status = status
    job.generation += 1
    job.conditions = set_conditions(job.conditions, *conditions, now=now)
    job.finished_at = now
    job.driver_lease_owner, job.driver_lease_expires_at = "", None
    job.save()
    Stage.objects.filter(job=job).update(active=False)
    checkpoint_uploads_withdraw(job=job)  # a checkpoint its driver never completed
    reconcile_soon()  # the freed nodes may let a queued job in
