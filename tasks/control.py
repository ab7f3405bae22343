"""The reconcile task (control queue): one level-triggered pass, short and safe to run concurrently, then the new
assignments it gave nodes, built ahead of their agents' next heartbeats (controlplane/jobs/prepared_assignments.py)."""

from __future__ import annotations

import logging

from controlplane.celery import RECONCILE_TASK, app
from controlplane.common.dispatch import dequeued
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.prepared_assignments import assignments_prepare

log = logging.getLogger(__name__)


@app.task(name=RECONCILE_TASK, ignore_result=True)
def reconcile() -> None:
    # No lock: two passes at once are safe because every write is checked against the generation the
    # pass saw (see controlplane/controller/executor.py).
    dequeued(RECONCILE_TASK)  # nudges from now on queue the next pass (controlplane.common.dispatch)
    report = reconcile_once()
    if report.applied or report.skipped:
        log.info("reconcile: %s", report)
    if report.reassigned:  # at once: an agent whose heartbeat comes first gets them from Django
        log.info("prepared the assignments of %d nodes", assignments_prepare(job_ids=report.reassigned))
