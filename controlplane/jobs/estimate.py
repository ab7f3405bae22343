"""Estimates: before submitting, what a job would get now: its placement, speed, time and price.

The web process only validates the job and records the request (`estimate_request`); a Celery worker runs
the placement solver (`controlplane/controller/estimate.py`, the task `arceus.estimate`), and the owner polls
the result (`estimate_get_for_user`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from arceus.model.registry import architecture_for_config
from arceus.model.tied import tied_groups
from controlplane.celery import ESTIMATE_TASK
from controlplane.common.dispatch import enqueue_on_commit
from controlplane.common.errors import one_by_id
from controlplane.datasets.selectors import dataset_config_resolved
from controlplane.jobs.models import EstimateStatus, JobEstimate
from controlplane.jobs.services import (
    job_replica_sync_check,
    job_replicas_check,
    job_staleness_check,
    job_validate,
)

# An estimate no worker took within this long is answered "failed" (its message expires unrun: the nodes it
# would have been planned on are old news by then); an owner's estimates are kept this long.
ESTIMATE_WAIT = timedelta(seconds=60)
ESTIMATE_KEPT = timedelta(days=1)


def estimate_request(
    *,
    owner: AbstractBaseUser,
    model_config: dict[str, Any],
    dataset_config: dict[str, Any],
    epochs: int,
    micro_batches: int,
    schedule: str,
    stages: int | None,
    requirements_config: dict[str, Any],
    tensor_parallel: dict[str, Any],
    optimizer: str,
    momentum: float,
    precision: str,
    activation_checkpointing: bool,
    replicas: dict[str, int] | None = None,
    replica_sync: dict[str, Any] | None = None,
    staleness: int = 0,
) -> JobEstimate:
    """Check the job as a submission would be checked (a 400 naming the field), record the request and
    enqueue its computation (the uploads the dataset config names resolved: the worker needs no owner)."""
    dataset_config = dataset_config_resolved(owner=owner, dataset_config=dataset_config)
    spec, _, _ = job_validate(
        model_config=model_config,
        dataset_config=dataset_config,
        stages=stages,
        requirements=requirements_config,
        tensor_parallel=tensor_parallel,
    )
    replicas = replicas or {"min": 1, "max": 1}
    if replicas["max"] > 1:
        job_replicas_check(replicas, micro_batches=micro_batches, tensor_parallel=tensor_parallel,
                           tied=bool(tied_groups(spec)))
    sync = job_replica_sync_check(replica_sync, replicas)
    job_staleness_check(staleness, replicas=replicas, tensor_parallel=tensor_parallel, audit_rate=None,
                        ships_program=architecture_for_config(model_config).ships_program)
    now = timezone.now()
    with transaction.atomic():
        JobEstimate.objects.filter(owner=owner, created_at__lt=now - ESTIMATE_KEPT).delete()
        estimate = JobEstimate.objects.create(
            owner=owner,
            request={
                "model_config": model_config,
                "dataset_config": dataset_config,
                "epochs": epochs,
                "micro_batches": micro_batches,
                "schedule": schedule,
                "staleness": staleness,
                "stages": stages,
                "optimizer": optimizer,
                "momentum": momentum,
                "precision": precision,
                "activation_checkpointing": activation_checkpointing,
                "requirements_config": requirements_config,
                "tensor_parallel": tensor_parallel,
                "replicas": replicas,
                "replica_sync": sync.to_json(),
            },
        )
        enqueue_on_commit(ESTIMATE_TASK, str(estimate.pk), expires=ESTIMATE_WAIT.total_seconds())
    return estimate


def estimate_get_for_user(*, user: AbstractBaseUser, estimate_id: str) -> JobEstimate:
    """The user's estimate; 404 for a malformed id and for another user's estimate alike. One no worker took
    in time is answered as failed."""
    estimate = one_by_id(JobEstimate.objects.filter(owner=user), "estimate", estimate_id)
    if estimate.status == EstimateStatus.PENDING and timezone.now() - estimate.created_at > ESTIMATE_WAIT:
        estimate.status = EstimateStatus.FAILED
        estimate.error = (
            f"no worker computed it within {ESTIMATE_WAIT.total_seconds():g} s (the control plane's Celery "
            "workers are busy or down); ask again"
        )
    return estimate
