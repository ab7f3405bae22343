"""Every job status transition the controller decides: place, run, requeue, rewind, succeed, fail; and a
succeeded job's placement for serving (placed, released). The owner's own (queue, cancel) are
`controlplane/jobs/owner_transitions.py`. Each checks the state it moves from (the generation, status or lease
it saw) and writes nothing when the job moved on meanwhile; each that frees or changes a placement bumps the
job's generation, so stale agents and drivers are refused, and nudges the reconciler.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, QuerySet, Value
from django.db.models.functions import Coalesce

from arceus.contracts.observed import ObservedState
from arceus.contracts.status import ACTIVE_STATUSES, TERMINAL_STATUSES, JobStatus
from controlplane.celery import TRAIN_JOB_TASK
from controlplane.common.conditions import FALSE, TRUE, Condition, set_conditions
from controlplane.common.dispatch import enqueue_on_commit, reconcile_soon
from controlplane.controller.actions import AddReplicas, DropReplicas, PlaceJob, ServeJob, StartDriver, StopServing
from controlplane.driver.progress import contributions_release
from controlplane.jobs.leases import lease_end
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.owner_transitions import job_end
from controlplane.jobs.step_grant import GrantWindow, step_grant, step_seconds_of
from controlplane.market.services import ledger_roll_back

# A stage row's timings of its recent steps, as its node measured them (controlplane/driver/progress.py).
STEP_MEASURES = ("step_compute_seconds", "step_wait_seconds", "step_micro_batches", "step_samples_per_second")


def job_place(action: PlaceJob, now: datetime) -> bool:
    """A queued job's placement: its stage rows at the next generation, status placing; activation checkpointing
    on from now where the placement chose it (the job's every later placement and assignment then has it)."""
    generation = action.generation + 1
    chosen = {"activation_checkpointing": True} if action.activation_checkpointing else {}
    updated = Job.objects.filter(pk=action.job_id, generation=action.generation, status=JobStatus.QUEUED).update(
        status=JobStatus.PLACING, generation=generation, conditions=list(action.conditions),
        next_replica=F("next_replica") + max(s.replica for s in action.stages) + 1, **chosen,
    )
    if not updated:
        return False
    Stage.objects.bulk_create(
        Stage(
            job_id=action.job_id,
            index=s.index,
            layer_start=s.layer_start,
            layer_end=s.layer_end,
            node_id=s.node_id,
            rank=s.rank,
            replica=s.replica,
            generation=generation,
            held_since=now,
        )
        for s in action.stages
    )
    return True


@transaction.atomic
def job_replicas_add(action: AddReplicas, now: datetime) -> bool:
    """More replicas of a running job's stages at its generation (no rewind): rows marked joining, so their agents
    build them without the checkpoint and the driver copies a live replica's state into them. False if the job
    moved on, or another pass gave out replica ids, since the snapshot."""
    updated = Job.objects.filter(
        pk=action.job_id, generation=action.generation, status=JobStatus.RUNNING, next_replica=action.next_replica
    ).update(next_replica=action.next_replica + len(action.stages), conditions=list(action.conditions))
    if not updated:
        return False
    Stage.objects.bulk_create(
        Stage(
            job_id=action.job_id, index=s.index, layer_start=s.layer_start, layer_end=s.layer_end, node_id=s.node_id,
            replica=s.replica, generation=action.generation, joining=True, held_since=now,
        )
        for s in action.stages
    )
    return True


@transaction.atomic
def job_replicas_drop(action: DropReplicas, now: datetime) -> bool:
    """Take replicas off their nodes without a rewind (their stage keeps another): their rows deleted, so their
    agents drop them and the driver's roster lets them go. False if the job moved on since the snapshot, or a replica
    dropped for its fences (`action.fenced`) is no longer fenced as often, or its stage would keep no replica that
    trains (one that holds its state and is not fenced)."""
    job = Job.objects.select_for_update().filter(
        pk=action.job_id, generation=action.generation, status=action.status
    ).first()
    if job is None:
        return False
    rows = Stage.objects.filter(job=job, active=True)
    gone = Q()
    for index, replica in action.replicas:
        gone |= Q(index=index, replica=replica)
    if action.fenced and not _fenced_out_holds(rows, gone, action.fenced):
        return False
    fenced_out = {(index, replica) for index, replica, _ in action.fenced}
    contributions_release(rows=list(rows.filter(gone)), now=now, fenced_out=fenced_out)  # still billed
    rows.filter(gone).delete()
    job.conditions = list(action.conditions)
    job.save(update_fields=["conditions"])
    reconcile_soon()  # their nodes are free again, and a new replica may take one
    return True


def _fenced_out_holds(rows: QuerySet[Stage], gone: Q, fenced: Collection[tuple[int, int, int]]) -> bool:
    """Whether the replicas of `fenced` ((index, replica, fences seen)) are still fenced, at least as often as seen,
    and each of their stages keeps a replica outside `gone` that trains: not fenced, not a joiner yet to copy."""
    for index, replica, fences in fenced:
        if not rows.filter(index=index, replica=replica, fenced_until_step__isnull=False, fences__gte=fences).exists():
            return False
        trains = rows.filter(index=index, fenced_until_step__isnull=True).exclude(gone).exclude(
            joining=True, joined__isnull=True
        )
        if not trains.exists():
            return False
    return True


def job_run(action: StartDriver, now: datetime) -> bool:
    """Status running, a driver task enqueued to claim the lease, and its agents granted steps from where it
    resumes (`step_grant`: a start's first window, or the window at its measured speed). Called in a transaction."""
    seen_lease: dict[str, Any] = (
        {"driver_lease_expires_at__isnull": True}
        if action.lease_expires_at is None
        else {"driver_lease_expires_at": action.lease_expires_at}
    )
    job = (
        Job.objects.filter(pk=action.job_id, generation=action.generation, status=action.status, **seen_lease)
        .select_for_update()
        .only("step", "total_steps", "step_grant", "samples_per_second", "dataset_config")
        .first()
    )
    if job is None:
        return False
    grant = step_grant(
        current=job.step_grant,
        recorded=job.step,
        total_steps=job.total_steps,
        step_seconds=step_seconds_of(
            batch_size=(job.dataset_config or {}).get("batch_size"), samples_per_second=job.samples_per_second
        ),
        window=GrantWindow(heartbeat_seconds=settings.ARCEUS_HEARTBEAT_INTERVAL_SECONDS),
    )
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.RUNNING,
        conditions=list(action.conditions),
        # No owner yet: the enqueued task claims the lease; if no task claims it in time (the message
        # was lost, or waits behind another job), the next pass enqueues another. Duplicates find the
        # lease taken and exit.
        driver_lease_owner="",
        driver_lease_expires_at=lease_end(now),
        started_at=Coalesce("started_at", Value(now)),
        step_grant=grant,
    )
    enqueue_on_commit(TRAIN_JOB_TASK, action.job_id)
    return True


@transaction.atomic
def job_requeue(*, job_id: Any, generation: int, reason: str, message: str, now: datetime) -> bool:
    """Take a placing job's placement back (e.g. a node was lost) so it is placed afresh; False if the
    job moved on since `generation` was observed."""
    job = Job.objects.select_for_update().filter(pk=job_id, generation=generation, status=JobStatus.PLACING).first()
    if job is None:
        return False
    job.stages.all().delete()
    job.status = JobStatus.QUEUED
    job.generation += 1
    job.conditions = set_conditions(
        job.conditions,
        Condition("Placed", FALSE, reason, message),
        Condition("StagesReady", FALSE, reason, message),
        now=now,
    )
    job.save(update_fields=["status", "generation", "conditions"])
    reconcile_soon()
    return True


@transaction.atomic
def job_rewind(
    *,
    job_id: Any,
    generation: int,
    moves: Mapping[tuple[int, int, int], Any] | None = None,
    count_restart: bool = False,
    culprits: Collection[Any] = (),
    reason: str,
    message: str,
    now: datetime,
) -> bool:
    """Send a placed job back to its last checkpoint: a new generation for every stage (so each rebuilds
    from that checkpoint and stale RPCs are refused), with the stage rows in `moves` ((index, rank, replica) ->
    a node id, or None to unplace: the job then waits as pending) re-placed. Rows not moved keep their node: a
    move of one replica leaves its siblings where they are. The work recorded past the checkpoint is refunded to
    the job's owner, who pays for its replay instead (`ledger_roll_back`); the nodes in `culprits` caused the rewind
    and lose their credit for it. False if the job moved on since `generation`; IntegrityError if a target node
    took another stage meanwhile."""
    job = Job.objects.select_for_update().filter(pk=job_id, generation=generation, status__in=ACTIVE_STATUSES).first()
    if job is None:
        return False
    moves = moves or {}
    job.generation += 1
    checkpoint = job.checkpoints.order_by("-step").first()
    stages = list(job.stages.filter(active=True))
    moved = [stage for stage in stages if (stage.index, stage.rank, stage.replica) in moves]
    for stage in stages:
        if stage in moved:
            stage.node_id, stage.held_since = moves[stage.index, stage.rank, stage.replica], now  # paid from now
            # what the old node measured is not the new one's (a driver routes a replica by its speed)
            for name in STEP_MEASURES:
                setattr(stage, name, None)
        stage.generation, stage.joining = job.generation, False
        # the new generation's driver fenced nobody, and its fences count afresh
        stage.fenced_until_step, stage.fenced_at, stage.fences, stage.fences_since_step = None, None, 0, None
        stage.observed_generation, stage.observed_state, stage.observed_message = None, ObservedState.PENDING, ""
    # Release the moved stages' old nodes first: one active stage per node is a database constraint.
    Stage.objects.filter(pk__in=[s.pk for s in moved]).update(node=None)
    Stage.objects.bulk_update(
        stages,
        ["node", "held_since", "generation", "joining", "fenced_until_step", "fenced_at", "fences", "fences_since_step",
         "observed_generation", "observed_state", "observed_message", *STEP_MEASURES],
    )
    unplaced = any(stage.node_id is None for stage in stages)
    job.status = JobStatus.PENDING if unplaced else JobStatus.PLACING
    job.resume_checkpoint = checkpoint
    job.step = checkpoint.step if checkpoint else 0
    ledger_roll_back(job_id=job.pk, after_step=job.step, culprits=culprits)
    job.restarts += int(count_restart)
    job.handover_requested = False
    job.driver_lease_owner, job.driver_lease_expires_at = "", None
    resume = f"resuming from the checkpoint of step {checkpoint.step}" if checkpoint else "restarting from step 0"
    placed = (
        Condition("Placed", FALSE, reason, message)
        if unplaced
        else Condition("Placed", TRUE, "Placed", message if moves else "stages kept on their nodes")
    )
    job.conditions = set_conditions(
        job.conditions,
        placed,
        Condition("StagesReady", FALSE, "Rewinding", f"every stage rebuilds; {resume}"),
        Condition("Training", FALSE, reason, f"{message}; {resume}"),
        Condition("Draining", FALSE, "NoNodeDraining", "no stage of the job is on a paused node"),
        now=now,
    )
    job.save()
    reconcile_soon()
    return True


@transaction.atomic
def job_fail(
    *, job_id: Any, generation: int, reason: str, message: str, culprits: Collection[Any] = (), now: datetime
) -> bool:
    """Mark the job failed with `message`; False (and nothing written) if it already ended, or if its
    placement changed since `generation`. The nodes in `culprits` caused it (a restart that used up the job's
    restarts): its work recorded past the last checkpoint is refunded and they lose their credit for it."""
    job = Job.objects.select_for_update().filter(pk=job_id, generation=generation).first()
    if job is None or job.status in TERMINAL_STATUSES:
        return False
    if culprits:
        newest = job.checkpoints.order_by("-step").values_list("step", flat=True).first()
        ledger_roll_back(job_id=job.pk, after_step=newest or 0, culprits=culprits)
    job.error = message
    job_end(
        job,
        JobStatus.FAILED,
        Condition("Training", FALSE, reason, message),
        Condition("Failed", TRUE, reason, message),
        now=now,
    )
    return True


@transaction.atomic
def job_succeed(*, job_id: Any, generation: int, summary: str, now: datetime) -> bool:
    """Move a running job to succeeded (its driver trained it to the end) and release its nodes; False if it moved
    on since `generation`."""
    job = Job.objects.select_for_update().filter(pk=job_id, generation=generation, status=JobStatus.RUNNING).first()
    if job is None:
        return False
    job_end(
        job,
        JobStatus.SUCCEEDED,
        Condition("Training", FALSE, "Completed", summary),
        Condition("Succeeded", TRUE, "Completed", summary),
        now=now,
    )
    return True


@transaction.atomic
def job_serve_place(action: ServeJob, now: datetime) -> bool:
    """A served job's placement: its stages (rank 0 rows) on the planned nodes at the next generation, running
    from its final checkpoint; False if the job moved on or its owner stopped serving it since the pass."""
    job = (
        Job.objects.select_for_update()
        .filter(pk=action.job_id, generation=action.generation, status=JobStatus.SUCCEEDED, serving=True)
        .first()
    )
    if job is None:
        return False
    job.generation += 1
    job.resume_checkpoint = job.checkpoints.order_by("-step").first()
    job.conditions = list(action.conditions)
    job.save(update_fields=["generation", "resume_checkpoint", "conditions"])
    # Off every node first: one active stage per node is a database constraint, and a stage may move onto the node
    # another one leaves.
    Stage.objects.filter(job=job, active=True).update(active=False, node=None)
    for s in action.stages:
        Stage.objects.update_or_create(
            job=job, index=s.index, rank=0, replica=0,
            defaults={
                "layer_start": s.layer_start, "layer_end": s.layer_end, "node_id": s.node_id, "active": True,
                "generation": job.generation, "observed_generation": None, "observed_state": ObservedState.PENDING,
                "observed_message": "",
            },
        )
    return True


@transaction.atomic
def job_serve_release(action: StopServing, now: datetime) -> bool:
    """Take a served job's stages off their nodes (a new generation, so its agents drop them); the owner's wish
    to serve it becomes `action.serving`. False if the job moved on since the pass."""
    updated = Job.objects.filter(pk=action.job_id, generation=action.generation, status=JobStatus.SUCCEEDED).update(
        generation=F("generation") + 1, serving=action.serving, conditions=list(action.conditions)
    )
    if not updated:
        return False
    Stage.objects.filter(job_id=action.job_id, active=True).update(active=False)
    reconcile_soon()  # the freed nodes may let another job in
    return True
