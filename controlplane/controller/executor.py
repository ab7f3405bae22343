"""Applies the reconciler's actions, each in its own transaction with an optimistic check (those that write only
their job's row share one, a savepoint each).

Every job write is `UPDATE ... WHERE id = %s AND generation = <seen> AND status = <seen>`: if another
pass (or a user, or the driver) changed the job since the snapshot, nothing matches and the action is
skipped and logged. Never a lock held across passes, so no Redis lock is needed either. The database
adds a second guard: unique (job, index, rank, replica) stage rows and at most one active row per node.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from arceus.contracts.status import JobStatus
from arceus.placement.solver import Budget
from controlplane.common import metrics
from controlplane.common.conditions import UNKNOWN
from controlplane.controller.actions import (
    Action,
    AddReplicas,
    DropReplicas,
    FailJob,
    MarkNodeUnknown,
    MovesHeld,
    PlaceJob,
    RequestHandover,
    RequeueJob,
    RewindJob,
    RollBackJob,
    ServeJob,
    SetCondition,
    StartDriver,
    StopServing,
    SucceedJob,
)
from controlplane.controller.moves import NODES_DISRUPTED, MoveGuard
from controlplane.controller.rollback import job_roll_back
from controlplane.controller.rules import plan
from controlplane.controller.snapshot import load_snapshot
from controlplane.controller.transitions import (
    job_fail,
    job_place,
    job_replicas_add,
    job_replicas_drop,
    job_requeue,
    job_rewind,
    job_run,
    job_serve_place,
    job_serve_release,
    job_succeed,
)
from controlplane.jobs.models import Job
from controlplane.nodes.liveness import leases_read
from controlplane.nodes.models import Node, ReadyStatus

log = logging.getLogger(__name__)


@dataclass
class ExecutionReport:
    applied: list[Action] = field(default_factory=list)
    skipped: list[Action] = field(default_factory=list)

    def __str__(self) -> str:
        return f"applied {_names(self.applied)}; skipped {_names(self.skipped)}"

    @property
    def reassigned(self) -> list[str]:
        """The jobs whose nodes this pass gave new assignments, to build ahead of their agents' next heartbeats
        (controlplane/jobs/prepared_assignments.py)."""
        return sorted({a.job_id for a in self.applied if _reassigns(a)})


def _names(actions: list[Action]) -> str:
    return ", ".join(f"{type(a).__name__}({_subject(a)})" for a in actions) or "none"


def _subject(action: Action) -> str:
    if isinstance(action, MovesHeld):
        return f"{action.reason}, {action.jobs} jobs"
    return str(getattr(action, "job_id", None) or action.node_id)


def reconcile_once(*, now: datetime | None = None) -> ExecutionReport:
    """One level-triggered pass: read everything, decide, apply."""
    with metrics.reconcile_pass():
        now = now or timezone.now()
        desired, observed = load_snapshot(now)
        guard = MoveGuard(settings.ARCEUS_MAX_MOVES_PER_PASS, settings.ARCEUS_DISRUPTION_THRESHOLD,
                          settings.ARCEUS_DISRUPTION_MIN_NODES)
        actions = plan(desired, observed, now, Budget(settings.ARCEUS_SOLVER_SECONDS),
                       max_placements=settings.ARCEUS_MAX_PLACEMENTS_PER_PASS, guard=guard)
        return execute(actions, now=now)


def execute(actions: Sequence[Action], *, now: datetime) -> ExecutionReport:
    report = ExecutionReport()
    marks = [a for a in actions if isinstance(a, MarkNodeUnknown)]
    if marks:  # thousands of nodes can go silent at once (a region's network): one transaction for them all
        marked = _mark_nodes_unknown(marks, now)
        for action in marks:
            (report.applied if action.node_id in marked else report.skipped).append(action)
    # A pass placing jobs sets dozens of conditions and starts dozens of drivers, each one UPDATE of its job's row:
    # one transaction for them all (a savepoint each), in the jobs' id order (the order `jobs_record_progress` locks
    # running jobs in), not a commit each.
    rows = sorted((a for a in actions if isinstance(a, ONE_ROW)), key=lambda a: str(a.job_id))
    if rows:
        with transaction.atomic():
            for action in rows:
                _apply(action, now, report)
    for action in actions:
        if isinstance(action, MovesHeld):
            _moves_held(action)
            report.applied.append(action)
        elif not isinstance(action, (MarkNodeUnknown, *ONE_ROW)):
            with transaction.atomic():
                _apply(action, now, report)
    return report


def _apply(action: Action, now: datetime, report: ExecutionReport) -> None:
    """`action` in a transaction (or a savepoint) of its own, recorded as applied or skipped."""
    try:
        with transaction.atomic():
            applied = _APPLY[type(action)](action, now)
    except IntegrityError as exc:
        log.info("skipped %s: the database refused it (%s)", _names([action]), exc)
        applied = False
    else:
        if not applied:
            log.info("skipped %s: the state changed since the snapshot", _names([action]))
    (report.applied if applied else report.skipped).append(action)


def _reassigns(action: Action) -> bool:
    """Whether `action`, applied, gave its job's nodes new assignments (changed an assignments version's columns:
    stage rows, a generation or a status). A job requeued, failed or no longer served leaves its nodes hosting
    fewer stages (often none: the quiet heartbeat answers those itself)."""
    if isinstance(action, StartDriver):
        return action.status == JobStatus.PLACING  # a driver restarted changes nothing its agents hold
    return isinstance(action, PlaceJob | RewindJob | RollBackJob | ServeJob | AddReplicas | DropReplicas)


def _moves_held(action: MovesHeld) -> None:
    """A pass that held lost stages where they are says so: in the log, and in the count of jobs held a pass."""
    metrics.LOST_MOVES_HELD.labels(reason=action.reason).inc(action.jobs)
    if action.reason == NODES_DISRUPTED:
        log.warning("%d of %d nodes hosting stages are silent at once: no lost stage moves (%d jobs wait; "
                    "ARCEUS_DISRUPTION_THRESHOLD)", action.silent, action.hosting, action.jobs)
    else:
        log.info("%d jobs' lost stages wait for a later pass (ARCEUS_MAX_MOVES_PER_PASS)", action.jobs)


@transaction.atomic
def _mark_nodes_unknown(actions: Sequence[MarkNodeUnknown], now: datetime) -> set[str]:
    """Mark each node Unknown whose lease is still the one its pass saw (no heartbeat since) and that is not
    Unknown yet; the ids marked. A heartbeat that lands after this check finds its node Unknown and makes it
    Ready again."""
    floors = dict(
        Node.objects.filter(pk__in=[a.node_id for a in actions], lease__isnull=False)
        .exclude(ready_status=ReadyStatus.UNKNOWN)
        .select_for_update(of=("self",))
        .values_list("pk", "lease__renewed_at")
    )
    liveness = leases_read({str(pk): floor for pk, floor in floors.items()}, now)
    by_message: dict[tuple[str, str], list[str]] = defaultdict(list)
    for action in actions:
        lease = liveness.get(action.node_id)
        if lease is not None and lease.renewed_at <= action.renewed_at:
            by_message[action.reason, action.message].append(action.node_id)
    for (reason, message), node_ids in by_message.items():
        Node.objects.filter(pk__in=node_ids).update(
            ready_status=UNKNOWN, ready_reason=reason, ready_message=message, ready_transition_at=now
        )
    marked = {node_id for node_ids in by_message.values() for node_id in node_ids}
    metrics.NODE_READY_TRANSITIONS.labels(ready=UNKNOWN).inc(len(marked))
    return marked


def _set_condition(action: SetCondition, now: datetime) -> bool:
    updated = Job.objects.filter(pk=action.job_id, generation=action.generation, status=action.status).update(
        conditions=list(action.conditions)
    )
    return bool(updated)


def _request_handover(action: RequestHandover, now: datetime) -> bool:
    updated = Job.objects.filter(
        pk=action.job_id, generation=action.generation, status=JobStatus.RUNNING, handover_requested=False
    ).update(handover_requested=True, conditions=list(action.conditions))
    return bool(updated)


def _requeue_job(action: RequeueJob, now: datetime) -> bool:
    return job_requeue(
        job_id=action.job_id,
        generation=action.generation,
        reason=action.reason,
        message=action.message,
        now=now,
    )


def _rewind_job(action: RewindJob, now: datetime) -> bool:
    return job_rewind(
        job_id=action.job_id,
        generation=action.generation,
        moves={(index, rank, replica): node for index, rank, replica, node in action.moves},
        count_restart=action.count_restart,
        culprits=action.culprits,
        reason=action.reason,
        message=action.message,
        now=now,
    )


def _fail_job(action: FailJob, now: datetime) -> bool:
    return job_fail(
        job_id=action.job_id,
        generation=action.generation,
        reason=action.reason,
        message=action.message,
        culprits=action.culprits,
        now=now,
    )


def _succeed_job(action: SucceedJob, now: datetime) -> bool:
    return job_succeed(job_id=action.job_id, generation=action.generation, summary=action.summary, now=now)


def _roll_back_job(action: RollBackJob, now: datetime) -> bool:
    return job_roll_back(
        job_id=action.job_id, generation=action.generation, node_ids=action.node_ids, message=action.message, now=now
    )


# Actions that write only their job's row, with its optimistic check (`execute` applies them together).
ONE_ROW = (SetCondition, StartDriver, RequestHandover)
_APPLY: dict[type, Callable[[Any, datetime], bool]] = {
    PlaceJob: job_place,
    SetCondition: _set_condition,
    StartDriver: job_run,
    RequeueJob: _requeue_job,
    RequestHandover: _request_handover,
    RewindJob: _rewind_job,
    FailJob: _fail_job,
    SucceedJob: _succeed_job,
    RollBackJob: _roll_back_job,
    ServeJob: job_serve_place,
    StopServing: job_serve_release,
    AddReplicas: job_replicas_add,
    DropReplicas: job_replicas_drop,
}
