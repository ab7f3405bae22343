"""Serving a finished job: the owner asks for its model to stay on agents so it can be sampled
(`controlplane/jobs/sampling.py`) without any one machine holding it. This records the wish (`Job.serving`); the
reconciler places the stages for inference from the final checkpoint, moves them off lost nodes, and releases
them when the wish is withdrawn (`controlplane/controller/rules.py`)."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from arceus.contracts.status import JobStatus
from arceus.model.registry import architecture_for_config, text_writers
from controlplane.common.conditions import FALSE, Condition, set_conditions
from controlplane.common.dispatch import reconcile_soon
from controlplane.common.errors import ApplicationError
from controlplane.jobs.models import Job


@transaction.atomic
def job_serve(*, job: Job, serving: bool, now: datetime | None = None) -> Job:
    """Ask for the job to be served (`serving`), or no longer; asking for what is already asked changes nothing.
    Only a succeeded text-writing job with a checkpoint of its final step is served (409 saying why not)."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    if serving == job.serving:
        return job
    now = now or timezone.now()
    if serving:
        _check_servable(job)
        condition = Condition("Serving", FALSE, "Requested", "waiting for the reconciler to place the stages")
    else:
        condition = Condition("Serving", FALSE, "Stopping", "serving stopped by its owner; releasing its nodes")
    job.serving = serving
    job.conditions = set_conditions(job.conditions, condition, now=now)
    job.save(update_fields=["serving", "conditions"])
    reconcile_soon()
    return job


def _check_servable(job: Job) -> None:
    if job.status != JobStatus.SUCCEEDED:
        how = {
            JobStatus.RUNNING: "sample it while it runs (POST /api/jobs/<id>/sample), or serve it once it succeeded",
            JobStatus.CREATED: "start it (POST /api/jobs/<id>/train) and serve it once it succeeded",
        }.get(JobStatus(job.status), "serve it once it succeeded (a failed or cancelled job can be started again)")
        raise ApplicationError.conflict(f"job {job.id} is {job.status}; only a succeeded job is served: {how}")
    if not architecture_for_config(job.model_config).writes_text:
        raise ApplicationError.conflict(
            f"job {job.id} trains a model of type {job.model_config.get('type')!r}; only a "
            f"{' or '.join(text_writers())} job is served (serving is for sampling text); download its model instead "
            "(GET /api/jobs/<id>/model)"
        )
    final = job.checkpoints.order_by("-step").first()
    if final is None or final.step != job.step:
        raise ApplicationError.conflict(
            f"job {job.id} has no checkpoint of its final step {job.step}, which serving loads; start a new job to "
            "train it again"
        )
