"""The training-driver task (training queue): one job's pipeline, run to the end under its driver lease."""

from __future__ import annotations

from controlplane.celery import TRAIN_JOB_TASK, app
from controlplane.driver.driving import job_drive


@app.task(name=TRAIN_JOB_TASK)
def run_job(job_id: str) -> str:
    return job_drive(job_id=job_id)
