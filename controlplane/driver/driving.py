"""Drive one job's training: claim its driver lease, run `arceus.training.train` over its stages with a
progress sink backed by the services, and end the job. The `arceus.train_job` Celery task runs this.

Idempotent through the driver lease: a duplicate or redelivered message finds the lease held by a live
driver and exits. The lease is renewed while the driver runs, however long a step takes, by the process's one
renewing thread (controlplane/driver/lease_renewals.py); a driver that died stops renewing, and the reconciler
rewinds the job to its last checkpoint and starts another.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, BinaryIO, TypeVar

from django.conf import settings
from django.utils import timezone

from arceus.contracts.transfer import transfer_config_from_json
from arceus.errors import SpecError
from arceus.model.expected_state import optimizer_kind
from arceus.training.driver import DriverError, train
from arceus.training.plan import ReplicaFence, ReplicaJoin, TrainPlan
from controlplane.common import metrics
from controlplane.common.db import reconnecting
from controlplane.common.errors import ApplicationError
from controlplane.datasets.tokens import dataset_samples_open
from controlplane.driver.lease_renewals import LEASES
from controlplane.driver.progress import job_finish, job_record_failure, stage_record_fenced, stage_record_joined
from controlplane.driver.sink import DbProgressSink
from controlplane.jobs.credentials import job_driver_token
from controlplane.jobs.leases import job_driver_claim, job_driver_interrupted
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import job_replica_endpoints, job_replicas_placed, job_stage_endpoints

log = logging.getLogger(__name__)
R = TypeVar("R")


def job_drive(*, job_id: str) -> str:
    """Train the job if no live driver holds its lease; what happened: "succeeded", "failed",
    "interrupted" (a stage failed; the reconciler takes it from here), "stopped" or "skipped"."""
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    job = job_driver_claim(job_id=job_id, owner=owner, now=timezone.now())
    if job is None:
        log.info("job %s: not running or another driver holds its lease; nothing to do", job_id)
        return "skipped"
    sink = DbProgressSink(job_id=str(job.id), lease_owner=owner, generation=job.generation)
    try:
        with (
            LEASES.renewing(job_id=str(job.id), owner=owner, on_lost=sink.lose_lease),
            metrics.DRIVERS_RUNNING.track_inprogress(),
        ):
            result = train(train_plan(job, lease_owner=owner), sink)
    except SpecError as exc:
        metrics.DRIVER_FAILURES.labels(reason="invalid").inc()
        message = str(exc)
        if _recorded(
            lambda: job_record_failure(job_id=job.id, lease_owner=owner, reason="DriverError", message=message),
            f"job {job_id}: recording its failure",
        ):
            log.warning("job %s failed: %s", job_id, exc)
            return "failed"
        return "stopped"
    except DriverError as exc:
        # A stage is unreachable or refused a call: the reconciler decides (move a lost stage, rewind
        # in place, or fail after too many restarts). If the lease is gone the job already moved on.
        metrics.DRIVER_FAILURES.labels(reason="interrupted").inc()
        message = str(exc)
        if _recorded(lambda: job_driver_interrupted(job_id=job.id, owner=owner, message=message, now=timezone.now()),
                     f"job {job_id}: giving its lease back"):
            log.warning("job %s: driver interrupted: %s", job_id, exc)
            return "interrupted"
        log.info("job %s: driver stopped (%s) after the job changed under it", job_id, exc)
        return "stopped"
    except Exception as exc:
        # A bug, not a stage failure: fail the job instead of letting the reconciler restart the
        # driver into the same crash forever.
        metrics.DRIVER_FAILURES.labels(reason="crashed").inc()
        log.exception("job %s: the driver crashed", job_id)
        message = f"driver crashed: {exc!r}"
        _recorded(lambda: job_record_failure(
            job_id=job.id, lease_owner=owner, reason="DriverCrashed", message=message
        ), f"job {job_id}: recording its failure")
        return "failed"
    sink.flush()
    if result.stopped or sink.lost_lease:
        # An agent's refusal of a step beyond the job's grant is a stop like a cancel: the control plane stopped
        # granting steps, and the reconciler decides what follows from the job's state (nothing is blamed here).
        log.info("job %s: driver stopped (%s)", job_id, result.stop_reason or "cancelled, or its lease was taken over")
        return "stopped"
    finished = _recorded(lambda: job_finish(
        job_id=job.id,
        lease_owner=owner,
        final_loss=result.final_loss,
        val_loss=result.val_loss,
        val_accuracy=result.val_accuracy,
        stages=result.stages,
        now=timezone.now(),
    ), f"job {job_id}: recording its end")
    return "succeeded" if finished else "stopped"


def _record_join(join: ReplicaJoin, *, job_id: str, lease_owner: str, generation: int) -> None:
    """What a joining replica copied, on its placement row (through a database restart, as the driver's progress)."""
    reconnecting(lambda: stage_record_joined(job_id=job_id, lease_owner=lease_owner, generation=generation, join=join,
                                             now=timezone.now()),
                 what=f"job {job_id}: recording a replica's join", for_seconds=settings.ARCEUS_DRIVER_LEASE_SECONDS)


def _record_fence(fence: ReplicaFence, *, job_id: str, lease_owner: str, generation: int) -> None:
    """A live replica the driver fenced, on its placement row (through a database restart, as a join)."""
    reconnecting(lambda: stage_record_fenced(job_id=job_id, lease_owner=lease_owner, generation=generation,
                                             fence=fence, now=timezone.now()),
                 what=f"job {job_id}: recording a replica's fence", for_seconds=settings.ARCEUS_DRIVER_LEASE_SECONDS)


def _recorded(call: Callable[[], R], what: str) -> R:
    """The driver's last word on its job (its end, failure or interruption), written through a database
    restart: retried with a fresh connection for as long as its lease could still be held."""
    return reconnecting(call, what=what, for_seconds=settings.ARCEUS_DRIVER_LEASE_SECONDS)


def train_plan(job: Job, *, lease_owner: str | None = None) -> TrainPlan:
    """The plan of the job's driver at its generation; a replicated job's roster starts from the replicas placed
    with it, and learns between steps of those that join (`replica_joins`) or were taken off (`replica_placed`).
    With `lease_owner` (the driver's), what each joiner copied, and each live replica it fenced, is recorded on its
    placement row."""
    replicas = job_replica_endpoints(job=job, joining=False) if job.replicated else ()
    lowest = {e.index: e for e in reversed(replicas)}
    return TrainPlan(
        job_id=str(job.id),
        generation=job.generation,
        stages=tuple(lowest[i] for i in sorted(lowest)) if replicas else job_stage_endpoints(job=job),
        replicas=replicas,
        replica_joins=functools.partial(job_replica_endpoints, job=job, joining=True) if replicas else None,
        replica_placed=functools.partial(job_replicas_placed, job_id=str(job.id), generation=job.generation)
        if replicas else None,
        replica_joined=functools.partial(_record_join, job_id=str(job.id), lease_owner=lease_owner,
                                         generation=job.generation) if replicas and lease_owner else None,
        replica_fenced=functools.partial(_record_fence, job_id=str(job.id), lease_owner=lease_owner,
                                         generation=job.generation) if replicas and lease_owner else None,
        dataset=job.dataset_config,
        epochs=job.epochs,
        learning_rate=job.learning_rate,
        micro_batches=job.micro_batches,
        schedule=job.schedule,
        staleness=job.staleness,
        seed=job.seed,
        credential=job_driver_token(job_id=str(job.id), generation=job.generation),
        rpc_timeout_seconds=settings.ARCEUS_RPC_TIMEOUT_SECONDS,
        start_step=job.resume_checkpoint.step if job.resume_checkpoint else 0,
        checkpoint_interval=job.checkpoint_interval_steps,
        audit_rate=job.audit_rate,
        audit_rtol=settings.ARCEUS_AUDIT_RTOL,
        audit_atol=settings.ARCEUS_AUDIT_ATOL,
        model=job.model_config,
        transfer=transfer_config_from_json(job.transfer),
        precision=job.precision,
        optimizer=optimizer_kind(job.optimizer, job.momentum),
        open_dataset=functools.partial(_open_dataset, job.owner_id),
    )


def _open_dataset(owner_id: Any, dataset_config: dict[str, Any]) -> BinaryIO:
    """The file the driver reads the job's upload from (its header, a spot check's rows): the tensor file, or the
    text's token file, tokenized here first where no job did yet. A SpecError if the upload is gone or does not
    tokenize."""
    try:
        return dataset_samples_open(owner_id=owner_id, dataset_config=dataset_config)
    except ApplicationError as exc:
        gone = exc.status == HTTPStatus.NOT_FOUND
        raise SpecError("dataset_config.dataset_id", f"{exc.message}: it was deleted" if gone else exc.message) from exc
