"""The training driver's lease on a running job: claimed by one driver task, renewed while it trains,
given up to hand over or after a stage error. Every progress write checks it (`held`), so a driver that
lost its lease (the job was cancelled, rewound, or taken over) learns it from a False return and stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet

from arceus.contracts.status import JobStatus
from controlplane.common.conditions import FALSE, Condition, set_conditions
from controlplane.common.dispatch import reconcile_soon
from controlplane.jobs.models import Job, Stage


def job_driver_claim(*, job_id: Any, owner: str, now: datetime) -> Job | None:
    """Take the driver lease of a running job in one UPDATE; None if another live driver holds it (or
    the job is not running). Claimable: a pending start (no owner yet) or an expired lease. The new driver fenced
    no replica: one its predecessor fenced trains again (paid from `now`)."""
    claimed = (
        Job.objects.filter(pk=job_id, status=JobStatus.RUNNING)
        .filter(Q(driver_lease_owner="") | Q(driver_lease_expires_at__isnull=True) | Q(driver_lease_expires_at__lt=now))
        .update(driver_lease_owner=owner, driver_lease_expires_at=lease_end(now))
    )
    if not claimed:
        return None
    stages_unfence(Stage.objects.filter(job_id=job_id), now)
    return Job.objects.get(pk=job_id)


def stages_unfence(stages: QuerySet[Stage], now: datetime) -> None:
    """The fenced ones of `stages` train again: their fence cleared, their nodes paid from `now` (`held_since` starts
    what the ledger bills, so the fenced time is never billed)."""
    stages.filter(fenced_at__isnull=False).update(fenced_until_step=None, fenced_at=None, held_since=now)


@transaction.atomic
def jobs_driver_renew(*, leases: Sequence[tuple[Any, str]], now: datetime) -> set[tuple[str, str]]:
    """Extend each driver lease, (job, owner), that its owner still holds, in one transaction of two queries whatever
    their number (a training worker's drivers: controlplane/driver/lease_renewals.py); those still held, each job as
    text. One no longer held (cancelled, rewound, taken over) is left as it is."""
    if not leases:
        return set()
    wanted = Q()
    for job_id, owner in leases:
        wanted |= Q(pk=job_id, driver_lease_owner=owner)
    still = list(
        Job.objects.filter(wanted, status=JobStatus.RUNNING)
        .select_for_update()
        .order_by("pk")  # the lock order of every batch of jobs (controlplane/driver/recording.py)
        .values_list("pk", "driver_lease_owner")
    )
    Job.objects.filter(pk__in=[pk for pk, _ in still]).update(driver_lease_expires_at=lease_end(now))
    return {(str(pk), owner) for pk, owner in still}


def job_handover_requested(*, job_id: Any) -> bool:
    """Whether a node of the job drains and the driver should checkpoint and hand over (the driver asks
    at its progress writes: a checkpoint can only be taken between steps anyway)."""
    return Job.objects.filter(pk=job_id, handover_requested=True).exists()


@transaction.atomic
def job_driver_handover(*, job_id: Any, owner: str, step: int, now: datetime) -> bool:
    """After the checkpoint of `step`, let go of the lease (claimed, expired) so the reconciler moves the
    draining stages and resumes from that checkpoint; False without the lease."""
    job = held(job_id, owner).select_for_update().first()
    if job is None:
        return False
    job.driver_lease_expires_at = now
    message = f"checkpointed step {step} to hand over the stages of a paused or leaving node"
    job.conditions = set_conditions(job.conditions, Condition("Training", FALSE, "HandedOver", message), now=now)
    job.save(update_fields=["driver_lease_expires_at", "conditions"])
    reconcile_soon()
    return True


@transaction.atomic
def job_driver_interrupted(*, job_id: Any, owner: str, message: str, now: datetime) -> bool:
    """The driver hit a stage error it cannot train through: give the lease up at once (keeping its
    owner, so the reconciler sees a claimed lease that expired) and say why; the reconciler then rewinds
    the job to its last checkpoint once each stage's node is heard from since or counts lost (moving its stage).
    False without the lease."""
    job = held(job_id, owner).select_for_update().first()
    if job is None:
        return False
    job.driver_lease_expires_at = now
    job.conditions = set_conditions(job.conditions, Condition("Training", FALSE, "DriverInterrupted", message), now=now)
    job.save(update_fields=["driver_lease_expires_at", "conditions"])
    reconcile_soon()
    return True


def job_driver_distrust(*, job_id: Any, owner: str, now: datetime) -> bool:
    """A spot check caught a node of the job wrong: the driver's lease ends at once (its owner too), so the driver
    stops at its next write and saves no checkpoint over the caught work; the reconciler rolls the job back from
    the failed checks. False without the lease."""
    ended = held(job_id, owner).update(driver_lease_owner="", driver_lease_expires_at=now)
    if ended:
        reconcile_soon()
    return bool(ended)


def held(job_id: Any, lease_owner: str) -> QuerySet[Job]:
    """The job, while `lease_owner` holds its driver lease (and it runs)."""
    return Job.objects.filter(pk=job_id, status=JobStatus.RUNNING, driver_lease_owner=lease_owner)


def lease_end(now: datetime) -> datetime:
    return now + timedelta(seconds=settings.ARCEUS_DRIVER_LEASE_SECONDS)


def renewed(now: datetime) -> dict[str, Any]:
    """The fields that renew the lease, for a holder's write that records something else too (one
    UPDATE)."""
    return {"driver_lease_expires_at": lease_end(now)}


def job_checkpointed(*, job: Job, checkpoint_id: Any, replaced_id: Any | None) -> None:
    """The lease holder saved a checkpoint (inside its transaction): the job made progress, so its restart
    count resets; if the checkpoint replaced the one the stages resume from, they resume from the new one."""
    fields: dict[str, Any] = {"restarts": 0}
    if replaced_id is not None and job.resume_checkpoint_id == replaced_id:
        fields["resume_checkpoint_id"] = checkpoint_id
        job.resume_checkpoint_id = checkpoint_id
    Job.objects.filter(pk=job.pk).update(**fields)
