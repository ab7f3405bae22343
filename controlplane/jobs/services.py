"""A job as its owner drives it: submit (validated against its dataset), start, cancel. The status
transitions they cause are `controlplane/jobs/owner_transitions.py`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from arceus.contracts.assignment import quantized_state_refusal
from arceus.contracts.replica_sync import ReplicaSync, replica_sync_from_json
from arceus.contracts.status import STARTABLE_STATUSES, JobStatus
from arceus.contracts.transfer import transfer_config_from_json
from arceus.data.paths import dataset_config_confined
from arceus.errors import SpecError
from arceus.model.registry import (
    architecture_for_config,
    check_tensor_parallel,
    dataset_config_defaulted,
    fit_model_to_dataset,
)
from arceus.model.spec import ModelSpec
from arceus.model.tied import tied_groups
from arceus.pipeline.schedule import staleness_check
from controlplane.common.errors import ApplicationError
from controlplane.datasets.selectors import dataset_config_resolved
from controlplane.jobs import owner_transitions
from controlplane.jobs.models import DEFAULT_AUDIT_RATE, Job

# Initialized (queued for placement, or placed and waiting for agents), training not begun.
WAITING_TO_TRAIN = (JobStatus.QUEUED, JobStatus.PLACING, JobStatus.PENDING)


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
    staleness: int = 0,
    transfer: dict[str, Any] | None = None,
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    requirements: dict[str, Any] | None = None,
    tensor_parallel: dict[str, Any] | None = None,
    replicas: dict[str, int] | None = None,
    replica_sync: dict[str, Any] | None = None,
    name: str = "",
) -> Job:
    """Validate the model and dataset against each other and save the job (status created).
    `audit_rate` None: DEFAULT_AUDIT_RATE, or 0 for a tensor-parallel job or an exported model (no spot checks of
    those yet: a checking agent would need the program of a stage it does not host) and for replicas that sync
    every few steps (their weights differ between syncs)."""
    tensor_parallel = tensor_parallel or {}
    spec, model_config, dataset = job_validate(
        model_config=model_config,
        dataset_config=dataset_config_resolved(owner=owner, dataset_config=dataset_config),
        stages=stages,
        requirements=requirements or {},
        tensor_parallel=tensor_parallel,
    )
    if tensor_parallel:
        tensor_parallel_check_options(audit_rate=audit_rate, activation_checkpointing=activation_checkpointing)
    ships_program = architecture_for_config(model_config).ships_program
    if ships_program and audit_rate:
        raise ApplicationError.invalid(
            "audit_rate", "an exported model's stages cannot be spot-checked yet; use 0 (or leave it out)"
        )
    replicas = replicas or {"min": 1, "max": 1}
    sync = job_replica_sync_check(replica_sync, replicas)
    job_staleness_check(staleness, replicas=replicas, tensor_parallel=tensor_parallel, audit_rate=audit_rate,
                        ships_program=ships_program)
    try:
        transfer_config = transfer_config_from_json(transfer or {})
    except SpecError as exc:
        raise ApplicationError.invalid(exc.field, exc.message) from exc
    refusal = quantized_state_refusal(
        optimizer, tensor_parallel=bool(tensor_parallel), averaged=replicas["max"] > 1 and not sync.exact
    )
    if refusal:
        raise ApplicationError.invalid("optimizer", refusal)
    if replicas["max"] > 1:
        job_replicas_check(
            replicas, micro_batches=micro_batches, tensor_parallel=tensor_parallel, audit_rate=audit_rate,
            exact=sync.exact, tied=bool(tied_groups(spec)),
        )
    if audit_rate is None:
        # Replicas that sync every step are spot-checked like any stage; replicas that sync every H steps are not.
        unchecked = tensor_parallel or ships_program or (replicas["max"] > 1 and not sync.exact) or staleness
        audit_rate = 0.0 if unchecked else DEFAULT_AUDIT_RATE
    return Job.objects.create(
        owner=owner,
        name=name or f"{dataset['name']}-{spec.type}-{spec.num_layers}-layers",
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
        staleness=staleness,
        transfer=transfer_config.to_json(),  # every field spelt out, so agents need no defaults of their own
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        requirements=requirements or {},
        tensor_parallel=tensor_parallel,
        replicas_min=replicas["min"],
        replicas_max=replicas["max"],
        replica_sync=sync.to_json(),
    )


def job_staleness_check(
    staleness: Any, *, replicas: dict[str, int], tensor_parallel: dict[str, Any], audit_rate: float | None,
    ships_program: bool,
) -> int:
    """A job's `staleness` (arceus.pipeline.schedule.staleness_check), or a 400 naming it: 1 is not supported yet
    with replicated stages, a tensor-parallel split, spot checks (they read the weights a step used) or an exported
    model (whose layers may keep buffers that training updates)."""
    try:
        staleness = staleness_check(staleness)
    except SpecError as exc:
        raise ApplicationError.invalid(exc.field, exc.message) from exc
    if not staleness:
        return staleness
    refused = (
        "replicated stages (replicas > 1)" if replicas["max"] > 1
        else "a tensor-parallel split" if tensor_parallel
        else "spot checks (audit_rate > 0)" if audit_rate
        else "an exported model" if ships_program
        else None
    )
    if refused:
        raise ApplicationError.invalid("staleness", f"staleness 1 is not supported with {refused} yet: use 0")
    return staleness


def job_replica_sync_check(replica_sync: dict[str, Any] | None, replicas: dict[str, int]) -> ReplicaSync:
    """A job's `replica_sync`, parsed (None: exact); a 400 naming the field for a bad one, or one without replicas."""
    if replica_sync is not None and replicas["max"] == 1:
        raise ApplicationError.invalid(
            "replica_sync", "applies only to replicated stages: ask for replicas > 1, or leave replica_sync out"
        )
    try:
        return replica_sync_from_json(replica_sync)
    except SpecError as exc:
        raise ApplicationError.invalid(exc.field, exc.message) from exc


def job_replicas_check(
    replicas: dict[str, int], *, micro_batches: int, tensor_parallel: dict[str, Any], audit_rate: float | None = None,
    exact: bool = True, tied: bool = False,
) -> None:
    """A 400 naming `replicas` for replicated stages the job cannot have: every replica takes at least one of a
    step's micro-batches, a tensor-parallel stage is not replicated, nor a model with tied weights (`tied`: the
    stages sharing one do not sum its gradient over replicas yet), and replicas that sync every few steps (`exact`
    False) are not spot-checked."""
    if replicas["max"] > micro_batches:
        raise ApplicationError.invalid(
            "replicas",
            f"asks for up to {replicas['max']} replicas per stage but a step has {micro_batches} micro-batches and "
            f"every replica takes at least one: use at most {micro_batches} replicas, or more micro_batches",
        )
    if tensor_parallel:
        raise ApplicationError.invalid(
            "replicas", "a tensor-parallel stage cannot be replicated yet: use replicas 1 or no tensor_parallel"
        )
    if tied:
        raise ApplicationError.invalid(
            "replicas",
            "a model with tied weights (model_config.tie_word_embeddings, or a captured module's shared parameters) "
            "cannot have replicated stages yet: use replicas 1",
        )
    if audit_rate and not exact:
        raise ApplicationError.invalid(
            "audit_rate",
            "replicas that sync every few steps (replica_sync.every_steps > 1) cannot be spot-checked yet: use "
            "audit_rate 0 (or leave it out)",
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
    _check_model_size(spec)
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
    """A split needs a model whose split layers divide evenly between the ranks, and named stages that
    exist."""
    try:
        check_tensor_parallel(spec, tensor_parallel["size"])
    except SpecError as exc:
        raise ApplicationError.invalid(exc.field, exc.message) from exc
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


def tensor_parallel_check_options(*, audit_rate: float | None, activation_checkpointing: bool = False) -> None:
    """The job options a tensor-parallel job cannot have (yet), as a 400 saying what to change."""
    if audit_rate:
        raise ApplicationError.invalid(
            "audit_rate",
            "tensor-parallel stages cannot be spot-checked yet; use 0 (or leave it out) or drop tensor_parallel",
        )
    if activation_checkpointing:
        # A recomputed forward would run its all-reduces again, out of the order every rank counts on.
        raise ApplicationError.invalid(
            "activation_checkpointing",
            "tensor-parallel stages cannot recompute their activations yet; use false or drop tensor_parallel",
        )


@transaction.atomic
def job_start(
    *, job: Job, epochs: int | None = None, learning_rate: float | None = None, now: datetime | None = None
) -> Job:
    """Queue the job for placement. Starting again trains from scratch: the previous attempt's placement,
    progress and checkpoints are dropped."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.status not in STARTABLE_STATUSES:
        raise ApplicationError.conflict(
            f"job {job.id} is {job.status}; only a created, failed or cancelled job can be started"
            + (" (submit a new job to train again)" if job.status == JobStatus.SUCCEEDED else "")
        )
    if architecture_for_config(job.model_config).ships_program and not (job.program and job.initial_weights):
        raise ApplicationError.conflict(
            f"job {job.id} is an exported model: upload its program (PUT /api/jobs/{job.id}/program) and its initial "
            f"weights (PUT /api/jobs/{job.id}/initial-weights) before starting it"
        )
    return owner_transitions.job_queue(job=job, epochs=epochs, learning_rate=learning_rate, now=now or timezone.now())


def job_initialize(*, job: Job, now: datetime | None = None) -> Job:
    """The prototype's `POST /api/network/initialize/<job>`: place the job's stages on the nodes there are, which
    here is queueing it (`job_start`): the reconciler places it and its conditions say what it waits for. Training
    begins once every stage's agent is ready; until then `job_train` may still set its epochs and learning rate."""
    return job_start(job=job, now=now)


@transaction.atomic
def job_train(
    *, job: Job, epochs: int | None = None, learning_rate: float | None = None, now: datetime | None = None
) -> Job:
    """The prototype's `POST /api/network/train/<job>`: start the job (`job_start`), or, for a job `job_initialize`
    queued that has not begun training, set the epochs and learning rate it will train with."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.status not in (*WAITING_TO_TRAIN, JobStatus.RUNNING):
        return job_start(job=job, epochs=epochs, learning_rate=learning_rate, now=now)
    if job.status == JobStatus.RUNNING or job.started_at is not None:
        asks = {k: v for k, v in (("epochs", epochs), ("learning_rate", learning_rate)) if v is not None}
        if all(getattr(job, key) == value for key, value in asks.items()):
            return job  # already training as asked
        raise ApplicationError.conflict(
            f"job {job.id} is {job.status} with epochs {job.epochs} and learning_rate {job.learning_rate}; "
            "those are fixed once training begins: cancel it and train again with the new values"
        )
    job.epochs = job.epochs if epochs is None else epochs
    job.learning_rate = job.learning_rate if learning_rate is None else learning_rate
    job.save(update_fields=["epochs", "learning_rate"])  # under the row lock the reconciler's run waits on
    return job


def job_cancel(*, job: Job, now: datetime | None = None, by: str = "its owner") -> Job:
    """Stop the job: agents drop its stages at their next heartbeat and its driver stops at its next
    progress write. `by`: who cancelled it (its owner, or an operator in the admin)."""
    return owner_transitions.job_cancel(job=job, now=now or timezone.now(), by=by)


def _check_model_size(spec: ModelSpec) -> None:
    """A model deeper than the placement solver handles quickly, or larger than the operator admits, is a 400
    before anything runs over it (the solver's time grows with the square of the layers)."""
    layers, limit = spec.num_layers, settings.ARCEUS_MAX_MODEL_LAYERS
    if layers > limit:
        raise ApplicationError.invalid(
            "model_config", f"has {layers} pipeline layers; this control plane takes at most {limit}"
        )
    params, limit = sum(spec.layer_params()), settings.ARCEUS_MAX_MODEL_PARAMETERS
    if params > limit:
        raise ApplicationError.invalid(
            "model_config", f"has {params:,} parameters; this control plane takes at most {limit:,}"
        )


def _fit_or_400(
    model_config: dict[str, Any], dataset_config: dict[str, Any]
) -> tuple[ModelSpec, dict[str, Any], dict[str, Any]]:
    try:
        dataset_config = dataset_config_defaulted(model_config, dataset_config)
        return fit_model_to_dataset(model_config, dataset_config_confined(dataset_config, settings.ARCEUS_DATA_ROOT))
    except SpecError as exc:
        raise ApplicationError.invalid(exc.field, exc.message) from exc
