"""Enqueue Celery tasks once the current transaction commits, by task name.

By name (`send_task`), so the control plane depends only on the Celery app's configuration in
`controlplane.celery`, never on the task modules, which import the control plane's services. The queue comes
from the app's task routes. Enqueueing is best effort: the periodic resync recomputes everything from
the database, so a lost message only costs one reconcile interval.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from controlplane.celery import RECONCILE_TASK, app


def enqueue_on_commit(task_name: str, *args: Any, expires: float | None = None) -> None:
    def send() -> None:
        app.send_task(task_name, args=args, expires=expires)

    transaction.on_commit(send, robust=True)


def reconcile_soon() -> None:
    """Nudge the reconciler after this transaction; it is level-triggered, so extra nudges are harmless
    and an old one is worthless (hence the expiry)."""
    enqueue_on_commit(RECONCILE_TASK, expires=30)
