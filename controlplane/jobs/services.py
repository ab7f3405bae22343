"""The job lifecycle: submit, start, cancel, requeue, fail (the driver's services are in progress.py)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from arceus.data import validate_dataset_config
from arceus.data.fit import fit_model_to_dataset
from arceus.errors import SpecError
from arceus.model.spec import GPTSpec, ModelSpec, model_spec_from_config
from arceus.wire.transfer import transfer_config_from_json
from controlplane.common.conditions import FALSE, TRUE, Condition, set_conditions
from controlplane.common.dispatch import reconcile_soon
from controlplane.common.errors import ApplicationError
from controlplane.jobs.checkpoints import checkpoints_delete
from controlplane.jobs.models import (
    ACTIVE_STATUSES,
    DEFAULT_AUDIT_RATE,
    STARTABLE_STATUSES,
    TERMINAL_STATUSES,
    Job,
    JobStatus,
    Stage,
    StageState,
)


def job_submit(
    *,
    owner: AbstractBaseUser,
    model_config: dict[str, Any],
    dataset_config: dict[str, Any],
    epochs: int = 1,
    learning_rate: float = 0.01,
    micro_batches: int = 1,
    optimizer: str = "sgd",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    seed: int = 0,
    stages: int | None = None,
    checkpoint_interval_steps: int = 50,
    audit_rate: float | None = None,
    node_grace_seconds: float | None = None,
    schedule: str = "gpipe",
    transfer: dict[str, Any] | None = None,
    precision: str = "fp32",
    requirements: dict[str, Any] | None = None,
    tensor_parallel: dict[str, Any] | None = None,
    name: str = "",
) -> Job:
    """Validate the model and dataset against each other and save the job (status created).
    `audit_rate` None: DEFAULT_AUDIT_RATE, or 0 for a tensor-parallel job (no spot checks of those yet)."""
    tensor_parallel = tensor_parallel or {}
    spec, model_config, dataset = job_validate(
        model_config=model_config,
        dataset_config=dataset_config,
        stages=stages,
        requirements=requirements or {},
        tensor_parallel=tensor_parallel,
    )
    if tensor_parallel:
        tensor_parallel_check_options(audit_rate=audit_rate)
    if audit_rate is None:
        audit_rate = 0.0 if tensor_parallel else DEFAULT_AUDIT_RATE
    try:
        transfer_config = transfer_config_from_json(transfer or {})
    except SpecError as exc:
        raise ApplicationError.invalid(exc.field, exc.message) from exc
    kind = "transformer" if isinstance(spec, GPTSpec) else "mlp"
    return Job.objects.create(
        owner=owner,
        name=name or f"{dataset['name']}-{kind}-{spec.num_layers}-layers",
        model_config=model_config,
        dataset_config=dataset,
        epochs=epochs,
        learning_rate=learning_rate,
        micro_batches=micro_batches,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=weight_decay,
        seed=seed,
        stages_requested=stages,
        checkpoint_interval_steps=checkpoint_interval_steps,
        audit_rate=audit_rate,
        node_grace_seconds=node_grace_seconds,
        schedule=schedule,
        transfer=transfer_config.to_json(),  # every field spelt out, so agents need no defaults of their own
        precision=precision,
        requirements=requirements or {},
        tensor_parallel=tensor_parallel,
    )


def job_validate(
    *,
    model_config: dict[str, Any],
    dataset_config: dict[str, Any],
    stages: int | None,
    requirements: dict[str, Any],
    tensor_parallel: dict[str, Any] | None = None,
) -> tuple[ModelSpec, dict[str, Any], dict[str, Any]]:
    """The checks of a submitted job that need the model: its spec and the model and dataset configs
    completed from each other (a transformer's vocab_size, the text's block_size), or a 400 naming the
    field. `tensor_parallel` is the normalised JobTensorParallelInput ({} for none)."""
    spec, model_config, dataset = _fit_or_400(model_config, dataset_config)
    if stages is not None and stages > spec.num_layers:
        raise ApplicationError.invalid(
            "stages",
            f"requested {stages} stages but the model has {spec.num_layers} layers; "
            f"use at most {spec.num_layers} (one layer per stage at least)",
        )
    tensor_parallel = tensor_parallel or {}
    if tensor_parallel:
        _check_tensor_parallel(spec, tensor_parallel, stages)
    size, split = tensor_parallel.get("size", 1), tensor_parallel.get("stages")

    def devices(stage_count: int) -> int:  # every rank of a split stage is a device of its own
        return stage_count + (size - 1) * (len(split) if split is not None else stage_count)

    low, high = requirements.get("min_devices"), requirements.get("max_devices")
    usable = devices(spec.num_layers)
    if low is not None and low > usable:
        raise ApplicationError.invalid(
            "requirements.min_devices",
            f"is {low} but the model has only {spec.num_layers} layers to spread"
            + (f" (at most {usable} devices with its tensor-parallel split)" if size > 1 else ""),
        )
    if high is not None and size > 1 and high < devices(1):
        raise ApplicationError.invalid(
            "requirements.max_devices", f"is {high} but a tensor-parallel stage alone needs {size} devices"
        )
    placed = devices(stages) if stages is not None else None
    if placed is not None and ((low is not None and low > placed) or (high is not None and high < placed)):
        raise ApplicationError.invalid(
            "stages",
            f"{stages} stages ({placed} devices) contradict requirements min_devices {low} / "
            f"max_devices {high}",
        )
    return spec, model_config, dataset


def _check_tensor_parallel(spec: ModelSpec, tensor_parallel: dict[str, Any], stages: int | None) -> None:
    """A split needs a transformer whose heads divide evenly between the ranks (its MLP then does too:
    4·d_model hidden units, and n_head divides d_model), and named stages that exist."""
    if not isinstance(spec, GPTSpec):
        raise ApplicationError.invalid(
            "tensor_parallel",
            'only a transformer\'s blocks split across nodes; use model_config.type "transformer" or drop '
            "tensor_parallel",
        )
    size = tensor_parallel["size"]
    if spec.n_head % size:
        divisors = [d for d in range(2, spec.n_head + 1) if spec.n_head % d == 0]
        raise ApplicationError.invalid(
            "tensor_parallel.size",
            f"must divide the model's n_head ({spec.n_head}) so each node takes whole attention heads; "
            + (f"use one of {', '.join(map(str, divisors))}" if divisors else "a single head cannot be split"),
        )
    split = tensor_parallel.get("stages")
    if split is None:
        return
    if stages is None:
        raise ApplicationError.invalid(
            "tensor_parallel.stages", "naming the stages to split needs a fixed stage count: set `stages` too"
        )
    if split[-1] >= stages:
        raise ApplicationError.invalid(
            "tensor_parallel.stages", f"names stage {split[-1]} but the job has {stages} stages (0-{stages - 1})"
        )


def tensor_parallel_check_options(*, audit_rate: float | None) -> None:
    """The job options a tensor-parallel job cannot have (yet), as a 400 saying what to change."""
    if audit_rate:
        raise ApplicationError.invalid(
            "audit_rate",
            "tensor-parallel stages cannot be spot-checked yet; use 0 (or leave it out) or drop tensor_parallel",
        )


@transaction.atomic
def job_start(
    *, job: Job, epochs: int | None = None, learning_rate: float | None = None, now: datetime | None = None
) -> Job:
    """Queue the job for placement. Starting again trains from scratch: the previous attempt's placement,
    progress and checkpoints are dropped."""
    now = now or timezone.now()
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.status not in STARTABLE_STATUSES:
        raise ApplicationError.conflict(
            f"job {job.id} is {job.status}; only a created, failed or cancelled job can be started"
            + (" (submit a new job to train again)" if job.status == JobStatus.SUCCEEDED else "")
        )
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
    job.step, job.total_steps, job.epoch = 0, None, 0
    job.last_loss = job.final_loss = job.val_loss = job.val_accuracy = job.samples_per_second = None
    job.error = ""
    job.driver_lease_owner, job.driver_lease_expires_at = "", None
    job.started_at, job.finished_at = None, None
    job.save()
    reconcile_soon()
    return job


@transaction.atomic
def job_cancel(*, job: Job, now: datetime | None = None) -> Job:
    """Stop the job: agents drop its stages at their next heartbeat and its driver stops at its next
    progress write."""
    now = now or timezone.now()
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.status in TERMINAL_STATUSES:
        raise ApplicationError.conflict(f"job {job.id} already {job.status}; there is nothing to cancel")
    _end(job, JobStatus.CANCELLED, Condition("Training", FALSE, "Cancelled", "cancelled by its owner"), now=now)
    return job


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
    moves: Mapping[tuple[int, int], Any] | None = None,
    count_restart: bool = False,
    reason: str,
    message: str,
    now: datetime,
) -> bool:
    """Send a placed job back to its last checkpoint: a new generation for every stage (so each rebuilds
    from that checkpoint and stale RPCs are refused), with the stage ranks in `moves` ((index, rank) ->
    a node id, or None to unplace: the job then waits as pending) re-placed. Ranks not moved keep their
    node. False if the job moved on since `generation`; IntegrityError if a target node took another
    stage meanwhile."""
    job = Job.objects.select_for_update().filter(pk=job_id, generation=generation, status__in=ACTIVE_STATUSES).first()
    if job is None:
        return False
    moves = moves or {}
    job.generation += 1
    checkpoint = job.checkpoints.order_by("-step").first()
    stages = list(job.stages.filter(active=True))
    moved = [stage for stage in stages if (stage.index, stage.rank) in moves]
    for stage in stages:
        if stage in moved:
            stage.node_id = moves[stage.index, stage.rank]
        stage.generation = job.generation
        stage.observed_generation, stage.observed_state, stage.observed_message = None, StageState.PENDING, ""
    # Release the moved stages' old nodes first: one active stage per node is a database constraint.
    Stage.objects.filter(pk__in=[s.pk for s in moved]).update(node=None)
    Stage.objects.bulk_update(
        stages, ["node", "generation", "observed_generation", "observed_state", "observed_message"]
    )
    unplaced = any(stage.node_id is None for stage in stages)
    job.status = JobStatus.PENDING if unplaced else JobStatus.PLACING
    job.resume_checkpoint = checkpoint
    job.step = checkpoint.step if checkpoint else 0
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
    *,
    job_id: Any,
    message: str,
    reason: str = "DriverError",
    generation: int | None = None,
    lease_owner: str | None = None,
    now: datetime | None = None,
) -> bool:
    """Mark the job failed with `message`; False (and nothing written) if it already ended, or if its
    placement changed since `generation`, or if `lease_owner` (a driver) no longer holds its lease."""
    job = Job.objects.select_for_update().filter(pk=job_id).first()
    if job is None or job.status in TERMINAL_STATUSES:
        return False
    if generation is not None and job.generation != generation:
        return False
    if lease_owner is not None and job.driver_lease_owner != lease_owner:
        return False
    job.error = message
    _end(
        job,
        JobStatus.FAILED,
        Condition("Training", FALSE, reason, message),
        Condition("Failed", TRUE, reason, message),
        now=now or timezone.now(),
    )
    return True


def _end(job: Job, status: JobStatus, *conditions: Condition, now: datetime) -> None:
    """Move a locked job to a terminal status and release its nodes (a placement change)."""
    job.status = status
    job.generation += 1
    job.conditions = set_conditions(job.conditions, *conditions, now=now)
    job.finished_at = now
    job.driver_lease_owner, job.driver_lease_expires_at = "", None
    job.save()
    Stage.objects.filter(job=job).update(active=False)
    reconcile_soon()  # the freed nodes may let a queued job in


def _fit_or_400(
    model_config: dict[str, Any], dataset_config: dict[str, Any]
) -> tuple[ModelSpec, dict[str, Any], dict[str, Any]]:
    # An MLP's own errors come before its dataset's, as they always did.
    is_mlp = not isinstance(model_config, dict) or str(model_config.get("type", "mlp")).lower() != "transformer"
    try:
        if is_mlp:
            model_spec_from_config(model_config)
        return fit_model_to_dataset(model_config, validate_dataset_config(dataset_config))
    except SpecError as exc:
        raise ApplicationError.invalid(exc.field, exc.message) from exc
