"""Reads the reconciler's view of the world from the database into plain snapshots.

A pass runs every second against 10,000 nodes (docs/architecture.md, "How the control plane grows"), so it reads in
one consistent snapshot only what the plan uses, as plain values: node rows are kept between passes and re-read only
where a row changed (`NodeRows`: PostgreSQL's row versions say which), and a model's layer costs are computed once
per distinct model config (`job_layers`). Liveness, prices, links and jobs are read afresh every pass.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import F, Max, Q, QuerySet, Sum
from django.utils import timezone

from arceus.contracts.replica_sync import replica_sync_from_json
from arceus.contracts.status import ACTIVE_STATUSES, JobStatus
from arceus.errors import SpecError
from arceus.model.expected_state import optimizer_kind
from arceus.model.registry import model_spec_from_config
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import LayerProfile
from controlplane.common.db import consistent_snapshot, row_versions_reliable
from controlplane.controller.placement import requirements, tensor_parallel_split, workload
from controlplane.controller.views import (
    Desired,
    DriverOutcome,
    FailedCheck,
    JobView,
    NodeView,
    Observed,
    PlacedStage,
    StageReport,
)
from controlplane.jobs.models import Checkpoint, Job, Stage, StageCheckpoint, StageContribution
from controlplane.market.models import LedgerEntry, SpotCheck
from controlplane.market.services import job_budget_micros, price_in_force
from controlplane.nodes.availability import in_windows, unavailable_reason
from controlplane.nodes.device_class import device_class, market_flops
from controlplane.nodes.labels import node_label
from controlplane.nodes.links import nodes_worst_neighbour_link
from controlplane.nodes.liveness import LeaseScores, Liveness, lease_scores
from controlplane.nodes.models import Node, NodeLease, Reachability


def load_snapshot(now: datetime | None = None) -> tuple[Desired, Observed]:
    """Everything one reconcile pass decides from, as of one moment of the database; `now` is when the owners'
    working hours are judged."""
    now = now or timezone.now()
    versioned = row_versions_reliable()  # asked before the snapshot's own transaction opens
    with consistent_snapshot():
        nodes = (_node_views(NODE_ROWS.read(), now, NODE_VIEWS) if versioned
                 else _node_views(_prepared(registered_nodes()), now))
        jobs = JOBS.read() if versioned else [job for _, job in _job_rows(None)]
    reports = {key: report for _, job_reports in jobs for key, report in job_reports}
    return Desired(jobs=tuple(view for view, _ in jobs)), Observed(nodes=nodes, stages=reports)


# What the planner reads of a node: rows of plain values, not model instances (10,000 of those cost seconds).
NODE_FIELDS = (
    "id", "name", "ready_status", "flops_fp32", "flops_measured", "memory_bytes", "max_memory_bytes",
    "runtime_memory_bytes", "device_type", "control_plane_bandwidth_bytes_per_second", "control_plane_rtt_seconds",
    "paused", "flagged_at", "flag_reason", "leaving_at", "work_windows", "idle_only", "idle_cpu_threshold",
    "lease__renewed_at", "lease__duration_seconds", "reachability", "exchange_reachable", "owner_id",
)


def registered_nodes() -> QuerySet[Node, dict[str, Any]]:
    return Node.objects.filter(registered_at__isnull=False, lease__isnull=False).values(*NODE_FIELDS)


def node_views(rows: Iterable[dict[str, Any]], now: datetime | None = None) -> tuple[NodeView, ...]:
    """Nodes (`registered_nodes()` rows) as the planner sees them: with their liveness (Redis, read in bulk),
    the posted price of their device class, the memory their owners offer, and whether their owners' controls
    let them work now."""
    return _node_views(_prepared(rows), now or timezone.now())


def _prepared(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """`registered_nodes()` rows with their id as text and their device class."""
    rows = list(rows)
    for row in rows:
        row["id"] = str(row["id"])
        row["flops"] = market_flops(row["flops_fp32"], row["flops_measured"])  # measured, not declared
        row["device_class"] = device_class(row["flops"], row["memory_bytes"] or 0)
    return rows


def _node_views(rows: list[dict[str, Any]], now: datetime, kept: NodeViews | None = None) -> tuple[NodeView, ...]:
    scores = lease_scores(now)
    prices = {klass: price_in_force(klass) for klass in {row["device_class"] for row in rows}}
    neighbour_links = nodes_worst_neighbour_link(None, now)
    return (kept or NodeViews()).views(rows, scores, prices, neighbour_links, now)


class NodeViews:
    """Nodes' views kept between passes. A node's view is built again only when something it is built from differs
    (its row, its price, its link; its owner's working hours or host load where it has such controls), and given its
    new lease renewal alone (`NodeView.renewed`) when only its heartbeat came. With 10,000 nodes heartbeating every
    10 s most are unchanged at each pass: which differ is found by comparing the whole lease, load and link maps with
    the previous pass's at once (set operations), so an unchanged node costs a lookup."""

    def __init__(self) -> None:
        # id -> (row, what else its view is built from, its lease's score in Redis or since when Redis holds leases,
        # the view)
        self._kept: dict[str, tuple[dict[str, Any], tuple[Any, ...], float | datetime, NodeView]] = {}
        self._seen: tuple[dict[str, float], dict[str, float], dict[str, tuple[float, float]], dict[str, float],
                          datetime] | None = None

    def views(
        self, rows: list[dict[str, Any]], scores: LeaseScores, prices: dict[str, float],
        links: dict[str, tuple[float, float]], now: datetime,
    ) -> tuple[NodeView, ...]:
        seen, self._seen = self._seen, (scores.renewed, scores.busy, links, prices, scores.since)
        if seen is None or seen[3] != prices or seen[4] != scores.since:
            dirty = None  # every node looked at
        else:  # the nodes whose lease, host load or link differ from the previous pass's (new, changed or gone)
            dirty = {k for k, _ in scores.renewed.items() ^ seen[0].items()}
            dirty.update(k for k, _ in scores.busy.items() ^ seen[1].items())
            dirty.update(k for k, _ in links.items() ^ seen[2].items())
        kept, views = {}, []
        for row in rows:
            node_id = row["id"]
            hit = self._kept.get(node_id)
            if dirty is None or hit is None or hit[0] is not row or node_id in dirty or row["work_windows"]:
                hit = self._view(row, hit, scores, prices, links, now)
            kept[node_id] = hit
            views.append(hit[3])
        self._kept = kept
        return tuple(views)

    @staticmethod
    def _view(
        row: dict[str, Any], hit: tuple[dict[str, Any], tuple[Any, ...], float | datetime, NodeView] | None,
        scores: LeaseScores, prices: dict[str, float], links: dict[str, tuple[float, float]], now: datetime,
    ) -> tuple[dict[str, Any], tuple[Any, ...], float | datetime, NodeView]:
        """`row`'s node's view, `hit` what was kept of it: kept, renewed or built again."""
        node_id = row["id"]
        inputs = (
            prices[row["device_class"]], links.get(node_id),
            scores.busy.get(node_id) if row["idle_only"] else None,
            in_windows(row["work_windows"], now),
        )
        score = scores.renewed.get(node_id)
        lease = score if score is not None else scores.since  # with no score: the floor, in the row
        if hit is None or (hit[0] is not row and hit[0] != row) or hit[1] != inputs:  # a re-read row: by content
            view = _node_view(row, scores.liveness(node_id, row["lease__renewed_at"]), inputs[0], now, inputs[1])
        elif hit[2] != lease:
            view = hit[3].renewed(scores.liveness(node_id, row["lease__renewed_at"]).renewed_at)
        else:
            view = hit[3]
        return row, inputs, lease, view


class VersionedRows:
    """Rows kept between passes, each under its version (PostgreSQL's `xmin` of the rows it was read from: any
    committed write gives a row a new one, so a registration, a pause, a flag, a Ready change, an admin edit, a
    stage's report, a deletion all change it). Each pass reads every version, one short column, and re-reads only
    the rows whose version changed, in the same snapshot. Only for a reader that sees committed rows alone
    (`row_versions_reliable`)."""

    # Past this many changed rows one read of them all costs less than a list of ids.
    READ_ALL_ABOVE = 1000

    def __init__(
        self, versions: Callable[[], dict[str, str]],
        rows: Callable[[list[str] | None], Iterable[tuple[str, Any]]],
    ) -> None:
        self._versions, self._read_rows = versions, rows  # rows(ids or None: all) -> (id, value) pairs
        self._kept: dict[str, tuple[str, Any]] = {}  # id -> (version, value)

    def read(self) -> list[Any]:
        """Every current row's value, in the versions' order."""
        versions = self._versions()
        changed = [key for key, version in versions.items() if self._kept.get(key, (None,))[0] != version]
        if changed:
            for key, value in self._read_rows(changed if len(changed) <= self.READ_ALL_ABOVE else None):
                if key in versions:
                    self._kept[key] = (versions[key], value)
        if len(self._kept) > len(versions):  # rows gone since (deleted, deregistered, finished)
            self._kept = {key: self._kept[key] for key in versions}
        return [self._kept[key][1] for key in versions]


def _registered_versions() -> dict[str, str]:
    """Registered node id -> the versions of its node and lease rows, in `registered_nodes()`'s order."""
    node, lease = Node._meta.db_table, NodeLease._meta.db_table
    return _versions(
        f'SELECT n.id::text, n.xmin::text || \'/\' || l.xmin::text FROM "{node}" n JOIN "{lease}" l '
        f"ON l.node_id = n.id WHERE n.registered_at IS NOT NULL ORDER BY n.created_at, n.id"
    )


def _registered_rows(ids: list[str] | None) -> Iterable[tuple[str, dict[str, Any]]]:
    rows = registered_nodes() if ids is None else registered_nodes().filter(pk__in=ids)
    return ((row["id"], row) for row in _prepared(rows))


def _versions(sql: str, params: Sequence[Any] = ()) -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return dict(cursor.fetchall())


def _node_view(
    row: dict[str, Any], liveness: Liveness, price_per_hour: float, now: datetime,
    neighbour_link: tuple[float, float] | None,
) -> NodeView:
    reason = unavailable_reason(
        paused=row["paused"],
        flag_reason=row["flag_reason"] if row["flagged_at"] else None,
        leaving=row["leaving_at"] is not None,
        work_windows=row["work_windows"],
        idle_only=row["idle_only"],
        idle_cpu_threshold=row["idle_cpu_threshold"],
        host_busy_fraction=liveness.host_busy_fraction,
        now=now,
    )
    offered = min(row["memory_bytes"] or 0, row["max_memory_bytes"] or row["memory_bytes"] or 0)
    memory = max(0, offered - row["runtime_memory_bytes"])  # what stages may use beside the agent's own
    # The worst link it measured to a pipeline neighbour, else its link to the control plane.
    bandwidth, rtt = neighbour_link or (row["control_plane_bandwidth_bytes_per_second"],
                                        row["control_plane_rtt_seconds"])
    return NodeView(
        id=row["id"],
        name=row["name"],
        ready_status=row["ready_status"],
        lease_renewed_at=liveness.renewed_at,
        lease_duration_seconds=row["lease__duration_seconds"],
        flops=row["flops"],
        memory_bytes=memory,
        paused=reason is not None,
        pause_reason=reason or "",
        device_type=row["device_type"] or "cpu",
        price_per_hour=price_per_hour,
        bandwidth_bytes_per_s=bandwidth or math.inf,
        latency_s=(rtt or 0.0) / 2,  # one way
        relayed=row["reachability"] == Reachability.RELAYED,
        exchange_reachable=row["exchange_reachable"] is not False,
        owner=str(row["owner_id"]),
        declared_flops=row["flops_fp32"] or 0.0,
    )


SNAPSHOT_STATUSES = (JobStatus.QUEUED, *ACTIVE_STATUSES)
# Served jobs too: succeeded ones asked to be served, or still holding nodes for it (controlplane/jobs/serving.py).
SERVED_SQL = (
    "(j.status = %s AND (j.serving OR EXISTS (SELECT 1 FROM \"{stage}\" h WHERE h.job_id = j.id AND h.active)))"
)


def _snapshot_jobs() -> QuerySet[Job]:
    holding = Stage.objects.filter(active=True).values("job")
    served = Q(status=JobStatus.SUCCEEDED) & (Q(serving=True) | Q(pk__in=holding))
    return Job.objects.filter(Q(status__in=SNAPSHOT_STATUSES) | served)

# What the planner reads of a job and of its active stages.
JOB_FIELDS = (
    "id", "status", "generation", "stages_requested", "model_config", "dataset_config", "micro_batches", "schedule",
    "staleness", "requirements", "conditions", "driver_lease_expires_at", "driver_lease_owner", "node_grace_seconds",
    "restarts",
    "handover_requested", "tensor_parallel", "serving", "driver_outcome", "driver_outcome_reason",
    "driver_outcome_message", "driver_outcome_generation", "replicas_min", "replicas_max", "next_replica", "owner_id",
    "replica_sync", "optimizer", "momentum", "activation_checkpointing", "precision",
)
STAGE_FIELDS = (
    "job_id", "index", "rank", "layer_start", "layer_end", "node_id", "generation", "observed_generation",
    "observed_state", "observed_message", "restarted_generation", "held_since", "replica", "step_samples_per_second",
    "joining", "joined", "fenced_until_step", "fences",
)


StageReports = tuple[tuple[tuple[str, int, int, int], StageReport], ...]  # ((job id, index, rank, replica), report)


def _job_versions() -> dict[str, str]:
    """Queued and active job id -> the versions of its row and of its active stages' rows, oldest job first; and
    the settings its view carries (the restart limit, the time to stop). A ledger entry is written with a write to
    its job's row (the driver's lease renewed, a rewind), so the row's version covers the charges too."""
    job, stage = Job._meta.db_table, Stage._meta.db_table
    return _versions(
        f"SELECT j.id::text, j.xmin::text || ':' || coalesce(string_agg(s.xmin::text, ',' "
        f"ORDER BY s.index, s.rank, s.replica), '') || ':' || %s "
        f"FROM \"{job}\" j LEFT JOIN \"{stage}\" s ON s.job_id = j.id AND s.active "
        f"WHERE j.status = ANY(%s) OR {SERVED_SQL.format(stage=stage)} GROUP BY j.id ORDER BY j.created_at, j.id",
        [f"{settings.ARCEUS_JOB_MAX_RESTARTS}/{settings.ARCEUS_JOB_STOP_SECONDS}/{settings.ARCEUS_REPLICA_MAX_FENCES}/"
         f"{settings.ARCEUS_REPLICA_FENCED_OUT_SECONDS}", list(SNAPSHOT_STATUSES),
         JobStatus.SUCCEEDED.value],
    )


def _job_rows(ids: list[str] | None) -> Iterable[tuple[str, tuple[JobView, StageReports]]]:
    """Queued and active jobs (all, or those of `ids`), oldest first, each with its active stages' reports."""
    jobs = _snapshot_jobs()
    stage_rows = Stage.objects.filter(active=True, job__in=_snapshot_jobs().values("pk"))
    if ids is not None:
        jobs, stage_rows = jobs.filter(pk__in=ids), stage_rows.filter(job_id__in=ids)
    stages: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in stage_rows.order_by("job_id", "index", "rank", "replica").values_list(*STAGE_FIELDS):
        stages[str(row[0])].append(row)
    job_rows = list(jobs.order_by("created_at", "id").values(*JOB_FIELDS))
    # What only some jobs have is asked of those alone (by id, each query skipped when none has it): a pass re-reads
    # the jobs whose progress was recorded since the one before (~100 a second for 1,000 running jobs), and these
    # four queries, each a join of the jobs' statuses, were most of that read.
    active = [row for row in job_rows if row["status"] in ACTIVE_STATUSES]
    replicated = [row["id"] for row in active if row["replicas_max"] > 1]
    checks = _failed_checks([row["id"] for row in active])
    billed = _billed([row["id"] for row in active if "max_total_usd" in row["requirements"]])
    released = _replicas_released(replicated)
    fenced_out = _replicas_released(replicated, fenced_out=True)
    for job in job_rows:
        job_id = str(job["id"])
        rows = stages.get(job_id, [])
        reports = tuple(
            ((job_id, r[1], r[2], r[12]), StageReport(generation=r[7], state=r[8], message=r[9])) for r in rows
        )
        view = _job_view(job, rows, checks.get(job_id, ()), billed.get(job_id), released.get(job_id, ()),
                         fenced_out.get(job_id, ()))
        yield job_id, (view, reports)


def _billed(job_ids: list[Any]) -> dict[str, tuple[int, dict[str, datetime]]]:
    """What these jobs (the active ones with a `max_total_usd`) have been charged, and when each node's billed time
    on them ends (its newest ledger entry's `held_until`)."""
    billed: dict[str, tuple[int, dict[str, datetime]]] = {}
    if not job_ids:
        return billed
    capped = LedgerEntry.objects.filter(job_id__in=job_ids)
    for job_id, charged in capped.values("job_id").annotate(charged=Sum("charge_micros")).values_list(
        "job_id", "charged"
    ):
        billed[str(job_id)] = (charged or 0, {})
    for job_id, node_id, until in (
        capped.filter(reverses=None, held_until__isnull=False).values("job_id", "node_id")
        .annotate(until=Max("held_until")).values_list("job_id", "node_id", "until")
    ):
        billed[str(job_id)][1][str(node_id)] = until
    return billed


def _replicas_released(
    job_ids: list[Any], *, fenced_out: bool = False
) -> dict[str, tuple[tuple[str, datetime], ...]]:
    """Each of these jobs' (the active replicated ones) (node id, when the newest replica of it was taken off that
    node; with `fenced_out`, only those dropped for being fenced too often). A drop writes its job's row too
    (`job_replicas_drop`), so a kept job is read again with them."""
    if not job_ids:
        return {}
    released = StageContribution.objects.filter(
        job_id__in=job_ids, released_at__isnull=False,
        **({"fenced_out": True} if fenced_out else {}),
    ).values("job_id", "node_id").annotate(at=Max("released_at")).order_by("job_id", "node_id")
    by_job: dict[str, list[tuple[str, datetime]]] = defaultdict(list)
    for job_id, node_id, at in released.values_list("job_id", "node_id", "at"):
        by_job[str(job_id)].append((str(node_id), at))
    return {job_id: tuple(rows) for job_id, rows in by_job.items()}


def _failed_checks(job_ids: list[Any]) -> dict[str, tuple[FailedCheck, ...]]:
    """These jobs' (the active ones) spot checks that failed at their current generation, oldest first. Recording one
    also ends the driver's lease (`job_driver_distrust`), a write to the job's row, so a kept job is read again with
    them."""
    if not job_ids:
        return {}
    failed = SpotCheck.objects.filter(job_id__in=job_ids, passed=False, generation=F("job__generation"))
    checks: dict[str, list[FailedCheck]] = defaultdict(list)
    for job_id, generation, node_id, name, node_owner, job_owner, detail in failed.order_by(
        "created_at", "id"
    ).values_list("job_id", "generation", "node_id", "node__name", "node__owner_id", "job__owner_id", "detail"):
        label = node_label(node_id=node_id, name=name, owner_id=node_owner, viewer_id=job_owner)
        checks[str(job_id)].append(FailedCheck(generation, str(node_id), label, detail))
    return {job_id: tuple(rows) for job_id, rows in checks.items()}


def _job_view(
    job: dict[str, Any], stages: list[tuple[Any, ...]], failed_checks: tuple[FailedCheck, ...],
    billed: tuple[int, dict[str, datetime]] | None, released: tuple[tuple[str, datetime], ...],
    fenced_out: tuple[tuple[str, datetime], ...],
) -> JobView:
    layers, spec_error = job_layers(json.dumps(job["model_config"], sort_keys=True))
    budget = job_budget_micros(job["requirements"])
    deadline = job["requirements"].get("deadline")
    charged, billed_until = billed or (0, {})

    def held_from(node_id: Any, held_since: datetime) -> datetime | None:
        if budget is None or node_id is None:
            return None
        until = billed_until.get(str(node_id))
        return held_since if until is None else max(held_since, until)

    return JobView(
        id=str(job["id"]),
        status=job["status"],
        generation=job["generation"],
        owner=str(job["owner_id"]),
        stages_requested=job["stages_requested"],
        layers=layers,
        workload=workload(
            job["dataset_config"], job["micro_batches"], job["schedule"],
            optimizer=optimizer_kind(job["optimizer"], job["momentum"]),
            activation_checkpointing=job["activation_checkpointing"], precision=job["precision"],
            staleness=job["staleness"],
        ),
        requirements=requirements(job["requirements"]),
        stages=tuple(
            PlacedStage(
                index=index, layer_start=start, layer_end=end, node_id=str(node_id) if node_id else None,
                generation=generation, rank=rank, restarted_generation=restarted, replica=replica,
                held_from=held_from(node_id, held_since), timed=speed is not None,
                joining=joining and joined is None, fenced=fenced_until_step is not None, fences=fences,
            )
            for _, index, rank, start, end, node_id, generation, *_, restarted, held_since, replica, speed, joining,
            joined, fenced_until_step, fences in stages
        ),
        conditions=tuple(job["conditions"]),
        driver_lease_expires_at=job["driver_lease_expires_at"],
        driver_claimed=bool(job["driver_lease_owner"]),
        spec_error=spec_error,
        node_grace_seconds=job["node_grace_seconds"],
        restarts=job["restarts"],
        handover_requested=job["handover_requested"],
        max_restarts=settings.ARCEUS_JOB_MAX_RESTARTS,
        tensor_parallel=tensor_parallel_split(job["tensor_parallel"]),
        serving=job["serving"],
        served_layers=_final_checkpoint_layers(job["id"]) if job["serving"] and job["status"] == JobStatus.SUCCEEDED
        else (),
        driver_outcome=DriverOutcome(
            job["driver_outcome_generation"], job["driver_outcome"], job["driver_outcome_reason"],
            job["driver_outcome_message"],
        ) if job["driver_outcome_generation"] is not None else None,
        failed_checks=failed_checks,
        max_total_micros=budget,
        deadline=None if deadline is None else datetime.fromisoformat(deadline),
        charged_micros=charged,
        stop_seconds=settings.ARCEUS_JOB_STOP_SECONDS,
        replicas_min=job["replicas_min"],
        replicas_max=job["replicas_max"],
        next_replica=job["next_replica"],
        replica_sync_every=replica_sync_from_json(job["replica_sync"]).every_steps,
        released=released,
        max_fences=settings.ARCEUS_REPLICA_MAX_FENCES,
        fenced_out=fenced_out,
        fenced_out_seconds=settings.ARCEUS_REPLICA_FENCED_OUT_SECONDS,
    )


def _final_checkpoint_layers(job_id: Any) -> tuple[tuple[int, int, int], ...]:
    """(index, layer_start, layer_end) of each stage of the job's newest checkpoint: what serving it places."""
    newest = Checkpoint.objects.filter(job_id=job_id).order_by("-step").values("pk")[:1]
    return tuple(
        StageCheckpoint.objects.filter(checkpoint__in=newest)
        .order_by("stage_index")
        .values_list("stage_index", "layer_start", "layer_end")
    )


@lru_cache(maxsize=4096)
def job_layers(model_config: str) -> tuple[tuple[LayerProfile, ...], str | None]:
    """A model config's (JSON, keys sorted) layer costs, or why it no longer validates: by the config's content, so
    a config that changes is a new entry; the same for every pass and every job that trains the same model."""
    try:
        return layer_profiles(model_spec_from_config(json.loads(model_config))), None
    except SpecError as exc:  # validated at submit, but the library may have tightened since
        return (), f"{exc.field}: {exc.message}"


# This process's (a worker runs one pass at a time).
NODE_ROWS = VersionedRows(_registered_versions, _registered_rows)
NODE_VIEWS = NodeViews()
JOBS = VersionedRows(_job_versions, _job_rows)
