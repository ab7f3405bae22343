"""The estimate task (control queue): a tenant's estimate, so the placement solver runs here and not in the
web process. Running it twice is harmless: an answered estimate is left as it is."""

from __future__ import annotations

from controlplane.celery import ESTIMATE_TASK, app
from controlplane.controller.estimate import estimate_run


@app.task(name=ESTIMATE_TASK, ignore_result=True)
def estimate(estimate_id: str) -> None:
    estimate_run(estimate_id=estimate_id)
