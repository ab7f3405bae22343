"""Enqueue Celery tasks once the current transaction commits, by task name.

By name (`send_task`), so the control plane depends only on the Celery app's configuration in
`controlplane.celery`, never on the task modules, which import the control plane's services. The queue comes
from the app's task routes. Enqueueing is best effort: the periodic resync recomputes everything from
the database, so a lost message only costs one reconcile interval.

Level-triggered tasks (a reconcile pass, a reachability sweep) are coalesced: a nudge while one is already queued
and not yet started adds nothing, because that queued run reads the database after this transaction committed.
10,000 agents' first heartbeats or dial-backs then cost a handful of passes, not 10,000 queued ones ahead of the
pass that places a job (`enqueue_coalesced`, and `dequeued` at the start of such a task).
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import TimeoutError as ResultTimeout
from django.conf import settings
from django.db import transaction

from controlplane.celery import CHECK_REACHABILITY_TASK, RECONCILE_TASK, app
from controlplane.common.redis_client import redis_client

QUEUED_KEY = "arceus:queued:{}"  # set while a coalesced task is queued and not started


def enqueue_on_commit(task_name: str, *args: Any, expires: float | None = None) -> None:
    def send() -> None:
        app.send_task(task_name, args=args, expires=expires)

    transaction.on_commit(send, robust=True)


def enqueue_coalesced(task_name: str, *, expires: float) -> None:
    """After this transaction, enqueue the argument-less `task_name` unless one is queued and not yet started. The
    mark lives as long as the message may wait, so a message that expired or was lost blocks nothing longer."""

    def send() -> None:
        key = QUEUED_KEY.format(task_name)
        if not redis_client().set(key, "1", nx=True, px=int(expires * 1000)):
            return
        try:
            app.send_task(task_name, expires=expires)
        except Exception:
            redis_client().delete(key)  # not queued after all: the next nudge must not be swallowed
            raise

    transaction.on_commit(send, robust=True)


def dequeued(task_name: str) -> None:
    """A coalesced task started: from here on, a nudge must queue another run (this one may have read too early)."""
    redis_client().delete(QUEUED_KEY.format(task_name))


def reconcile_soon() -> None:
    """Nudge the reconciler after this transaction; it is level-triggered, so extra nudges are harmless
    and an old one is worthless (hence the expiry)."""
    enqueue_coalesced(RECONCILE_TASK, expires=30)


def reachability_check_soon() -> None:
    """Nudge a dial-back sweep (controlplane/nodes/reachability.py) after this transaction (coalesced: one queued
    sweep serves every registration before it)."""
    enqueue_coalesced(CHECK_REACHABILITY_TASK, expires=max(300.0, settings.ARCEUS_REACHABILITY_SWEEP_SECONDS))


def task_result(task_name: str, *, timeout: float, **kwargs: Any) -> Any | None:
    """Run `task_name` on a worker now and wait up to `timeout` seconds for what it returns; None if no worker
    answered in time (the message expires then, so a late worker does not run it for nobody). Sent at once, not on
    commit: the caller waits for it, and it reads only what is already committed."""
    result = app.send_task(task_name, kwargs=kwargs, expires=timeout)
    try:
        return result.get(timeout=timeout)
    except ResultTimeout:
        return None
    finally:
        result.forget()
