"""The reconcile task (control queue): one level-triggered pass, short and safe to run concurrently."""

from __future__ import annotations

import logging

from controlplane.celery import RECONCILE_TASK, app
from controlplane.common.dispatch import dequeued
from controlplane.controller.executor import reconcile_once

log = logging.getLogger(__name__)


@app.task(name=RECONCILE_TASK, ignore_result=True)
def reconcile() -> None:
    # No lock: two passes at once are safe because every write is checked against the generation the
    # pass saw (see controlplane/controller/executor.py).
    dequeued(RECONCILE_TASK)  # nudges from now on queue the next pass (controlplane.common.dispatch)
    report = reconcile_once()
    if report.applied or report.skipped:
        log.info("reconcile: %s", report)
