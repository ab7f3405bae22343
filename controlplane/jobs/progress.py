"""Services the training driver calls: claim the driver lease, record progress, finish.

Every write is guarded by the lease (status running and `driver_lease_owner` = the caller), so a driver
that lost its lease, or whose job was cancelled, learns it from a False return and stops; and each
progress write renews the lease.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet

from arceus.errors import SpecError
from arceus.model.spec import GPTSpec, model_spec_from_config
from controlplane.common.conditions import FALSE, TRUE, Condition, set_conditions
from controlplane.common.dispatch import reconcile_soon
from controlplane.jobs.models import EpochMetric, Job, JobStatus, LossPoint, Stage, StageContribution
from controlplane.market.services import WorkCounters, ledger_record_work


@dataclass(frozen=True)
class StepPoint:
    epoch: int
    step: int
    total_steps: int
    loss: float
    samples_per_second: float


@dataclass(frozen=True)
class StageCounters:
    index: int
    samples: int
    micro_batches: int
    compute_seconds: float
    bytes_sent: int
    bytes_received: int
    node_id: str = ""  # which rank's of a tensor-parallel stage; "": the stage's (its rank 0's)


def job_driver_claim(*, job_id: Any, owner: str, now: datetime) -> Job | None:
    """Take the driver lease of a running job in one UPDATE; None if another live driver holds it (or
    the job is not running). Claimable: a pending start (no owner yet) or an expired lease."""
    claimed = (
        Job.objects.filter(pk=job_id, status=JobStatus.RUNNING)
        .filter(Q(driver_lease_owner="") | Q(driver_lease_expires_at__isnull=True) | Q(driver_lease_expires_at__lt=now))
        .update(driver_lease_owner=owner, driver_lease_expires_at=_lease_end(now))
    )
    return Job.objects.get(pk=job_id) if claimed else None


def job_driver_renew(*, job_id: Any, owner: str, now: datetime) -> bool:
    """Extend the caller's driver lease; False if it no longer holds it (cancelled, rewound, taken over)."""
    return bool(_held(job_id, owner).update(driver_lease_expires_at=_lease_end(now)))


def job_handover_requested(*, job_id: Any) -> bool:
    """Whether a node of the job drains and the driver should checkpoint and hand over (the driver asks
    at its progress writes: a checkpoint can only be taken between steps anyway)."""
    return Job.objects.filter(pk=job_id, handover_requested=True).exists()


@transaction.atomic
def job_driver_handover(*, job_id: Any, owner: str, step: int, now: datetime) -> bool:
    """After the checkpoint of `step`, let go of the lease (claimed, expired) so the reconciler moves the
    draining stages and resumes from that checkpoint; False without the lease."""
    job = _held(job_id, owner).select_for_update().first()
    if job is None:
        return False
    job.driver_lease_expires_at = now
    message = f"checkpointed step {step} to hand back the stages of a paused node"
    job.conditions = set_conditions(job.conditions, Condition("Training", FALSE, "HandedOver", message), now=now)
    job.save(update_fields=["driver_lease_expires_at", "conditions"])
    reconcile_soon()
    return True


@transaction.atomic
def job_driver_interrupted(*, job_id: Any, owner: str, message: str, now: datetime) -> bool:
    """The driver hit a stage error it cannot train through: give the lease up at once (keeping its
    owner, so the reconciler sees a claimed lease that expired) and say why; the reconciler then rewinds
    the job to its last checkpoint, moving stages whose node is lost. False without the lease."""
    job = _held(job_id, owner).select_for_update().first()
    if job is None:
        return False
    job.driver_lease_expires_at = now
    job.conditions = set_conditions(job.conditions, Condition("Training", FALSE, "DriverInterrupted", message), now=now)
    job.save(update_fields=["driver_lease_expires_at", "conditions"])
    reconcile_soon()
    return True


@transaction.atomic
def job_record_steps(
    *,
    job_id: Any,
    lease_owner: str,
    points: Sequence[StepPoint],
    now: datetime,
    stages: Sequence[StageCounters] = (),
) -> bool:
    """Record a batch of training steps (the newest becomes the job's progress) and the stages' latest
    counters, and renew the lease; with no points it only renews. False if the caller no longer holds
    the lease."""
    fields: dict[str, Any] = {"driver_lease_expires_at": _lease_end(now)}
    if points:
        last = points[-1]
        fields.update(
            step=last.step,
            total_steps=last.total_steps,
            epoch=last.epoch,
            last_loss=_finite(last.loss),
            samples_per_second=_finite(last.samples_per_second),
        )
    if not _held(job_id, lease_owner).update(**fields):
        return False
    # Upsert: a restarted driver replays steps it recorded before.
    LossPoint.objects.bulk_create(
        [
            LossPoint(
                job_id=job_id,
                step=p.step,
                epoch=p.epoch,
                loss=_finite(p.loss),
                samples_per_second=_finite(p.samples_per_second),
            )
            for p in points
        ],
        update_conflicts=True,
        unique_fields=["job", "step"],
        update_fields=["epoch", "loss", "samples_per_second"],
    )
    _record_counters(job_id, stages)
    return True


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
    held = _held(job_id, lease_owner).update(
        val_loss=_finite(val_loss),
        val_accuracy=_finite(val_accuracy),
        driver_lease_expires_at=_lease_end(now),
    )
    if not held:
        return False
    EpochMetric.objects.update_or_create(
        job_id=job_id,
        epoch=epoch,
        defaults={"val_loss": _finite(val_loss), "val_accuracy": _finite(val_accuracy)},
    )
    _record_counters(job_id, stages)
    return True


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
    """Mark the job succeeded and release its nodes; False if the caller no longer holds the lease."""
    job = _held(job_id, lease_owner).select_for_update().first()
    if job is None:
        return False
    accuracy = _finite(val_accuracy)
    summary = f"trained {job.step} steps" + (f", val accuracy {accuracy:.4f}" if accuracy is not None else "")
    job.status = JobStatus.SUCCEEDED
    job.generation += 1
    job.final_loss, job.val_loss, job.val_accuracy = _finite(final_loss), _finite(val_loss), accuracy
    job.conditions = set_conditions(
        job.conditions,
        Condition("Training", FALSE, "Completed", summary),
        Condition("Succeeded", TRUE, "Completed", summary),
        now=now,
    )
    job.finished_at = now
    job.driver_lease_owner, job.driver_lease_expires_at = "", None
    job.save()
    _record_counters(job_id, stages)
    Stage.objects.filter(job_id=job_id).update(active=False)
    reconcile_soon()  # the freed nodes may let a queued job in
    return True


def _held(job_id: Any, lease_owner: str) -> QuerySet[Job]:
    return Job.objects.filter(pk=job_id, status=JobStatus.RUNNING, driver_lease_owner=lease_owner)


def _record_counters(job_id: Any, stages: Sequence[StageCounters]) -> None:
    """Store the stages' counters (cumulative within the current generation) on the stage rows, on each
    node's contribution row for this generation, and as priced ledger entries; called only by the lease
    holder, so the stage rows are the ones the counters came from."""
    if not stages:
        return
    rows = list(Stage.objects.filter(job_id=job_id, active=True).select_related("node", "job"))
    placed = {(s.index, str(s.node_id)): s for s in rows} | {(s.index, ""): s for s in rows if s.rank == 0}
    ranks = Counter(s.index for s in rows)
    contributions = []
    for s in stages:
        counters = {
            "samples": s.samples,
            "micro_batches": s.micro_batches,
            "compute_seconds": s.compute_seconds,
            "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received,
        }
        stage = placed.get((s.index, s.node_id))
        if stage is None or stage.node is None:
            continue
        Stage.objects.filter(pk=stage.pk).update(**counters)
        contributions.append(
            StageContribution(
                job_id=job_id, stage_index=s.index, generation=stage.generation, node_id=stage.node_id, **counters
            )
        )
        ledger_record_work(
            job_id=job_id,
            stage_index=s.index,
            generation=stage.generation,
            node=stage.node,
            counters=WorkCounters(**counters),
            flops_per_sample=_stage_flops_per_sample(stage, ranks[stage.index]),
        )
    StageContribution.objects.bulk_create(
        contributions,
        update_conflicts=True,
        unique_fields=["job", "stage_index", "generation", "node"],
        update_fields=["samples", "micro_batches", "compute_seconds", "bytes_sent", "bytes_received", "updated_at"],
    )


def _stage_flops_per_sample(stage: Stage, ranks: int) -> float:
    """The forward FLOPs per sample the stage's node does: a tensor-parallel rank does its share of
    each transformer block (embedding and head are whole on every rank)."""
    try:
        spec = model_spec_from_config(stage.job.model_config)
    except SpecError:
        return 0.0  # validated at submit; a model the library no longer accepts is not billed by FLOPs
    costs = spec.layer_flops_per_sample()
    split = range(1, spec.n_layer + 1) if isinstance(spec, GPTSpec) else range(0)
    return float(sum(costs[i] / (ranks if i in split else 1) for i in range(stage.layer_start, stage.layer_end)))


def _lease_end(now: datetime) -> datetime:
    return now + timedelta(seconds=settings.ARCEUS_DRIVER_LEASE_SECONDS)


def _finite(value: float | None) -> float | None:
    """NaN and infinities are not JSON; the API shows them as null."""
    return float(value) if value is not None and math.isfinite(value) else None
