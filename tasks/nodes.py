"""The reachability sweep (reachability queue): dial back the nodes whose reachability is unknown. Running it twice
is harmless: each run records what it measured, guarded by the registration it dialled."""

from __future__ import annotations

import logging

from controlplane.celery import CHECK_REACHABILITY_TASK, app
from controlplane.common.dispatch import dequeued
from controlplane.nodes.reachability import nodes_check_reachability

log = logging.getLogger(__name__)


@app.task(name=CHECK_REACHABILITY_TASK, ignore_result=True)
def check_reachability() -> None:
    dequeued(CHECK_REACHABILITY_TASK)  # registrations from now on queue the next sweep
    counts = nodes_check_reachability()
    if any(counts.values()):
        log.info("reachability: %s", counts)
