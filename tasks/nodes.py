"""The reachability task (control queue): dial a newly registered agent back. Running it twice is harmless: each
run records what it measured, and one for an older registration changes nothing."""

from __future__ import annotations

from datetime import datetime

from controlplane.celery import CHECK_REACHABILITY_TASK, app
from controlplane.nodes.reachability import node_check_reachability


@app.task(name=CHECK_REACHABILITY_TASK, ignore_result=True)
def check_reachability(node_id: str, registered_at: str) -> None:
    node_check_reachability(node_id=node_id, registered_at=datetime.fromisoformat(registered_at))
