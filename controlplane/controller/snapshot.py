"""Reads the reconciler's view of the world from the database into plain snapshots."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Prefetch, Q, QuerySet
from django.utils import timezone

from arceus.contracts.status import ACTIVE_STATUSES, JobStatus
from arceus.errors import SpecError
from arceus.model.registry import model_spec_from_config
from arceus.placement.profiles import layer_profiles
from controlplane.controller.placement import requirements, tensor_parallel_split, workload
from controlplane.controller.rules import Desired, JobView, NodeView, Observed, PlacedStage, StageReport
from controlplane.jobs.models import Job, Stage, StageCheckpoint
from controlplane.market.pricing import device_class
from controlplane.market.services import price_in_force
from controlplane.nodes.availability import unavailable_reason
from controlplane.nodes.links import nodes_worst_neighbour_link
from controlplane.nodes.liveness import Liveness, leases_read
from controlplane.nodes.models import Node, Reachability


def load_snapshot(now: datetime | None = None) -> tuple[Desired, Observed]:
    """Everything one reconcile pass decides from; `now` is when the owners' working hours are judged."""
    nodes = node_views(registered_nodes(), now)
    # Served jobs: succeeded ones asked to be served, or still holding nodes for it.
    holding = Stage.objects.filter(active=True).values("job")
    served = Q(status=JobStatus.SUCCEEDED) & (Q(serving=True) | Q(pk__in=holding))
    jobs = (
        Job.objects.filter(Q(status__in=(JobStatus.QUEUED, *ACTIVE_STATUSES)) | served)
        .prefetch_related(Prefetch("stages", queryset=Stage.objects.filter(active=True).order_by("index", "rank")))
        .order_by("created_at")
    )
    views, reports = [], {}
    for job in jobs:
        views.append(_job_view(job))
        for stage in job.stages.all():
            reports[(str(job.id), stage.index, stage.rank)] = StageReport(
                generation=stage.observed_generation,
                state=stage.observed_state,
                message=stage.observed_message,
            )
    return Desired(jobs=tuple(views)), Observed(nodes=nodes, stages=reports)


# What the planner reads of a node: rows of plain values, not model instances (10,000 of those cost seconds).
NODE_FIELDS = (
    "id", "name", "ready_status", "flops_fp32", "memory_bytes", "max_memory_bytes", "runtime_memory_bytes",
    "device_type", "control_plane_bandwidth_bytes_per_second", "control_plane_rtt_seconds", "paused", "flagged_at",
    "flag_reason", "leaving_at", "work_windows", "idle_only", "idle_cpu_threshold", "lease__renewed_at",
    "lease__duration_seconds", "reachability",
)


def registered_nodes() -> QuerySet[Node, dict[str, Any]]:
    return Node.objects.filter(registered_at__isnull=False, lease__isnull=False).values(*NODE_FIELDS)


def node_views(rows: Iterable[dict[str, Any]], now: datetime | None = None) -> tuple[NodeView, ...]:
    """Nodes (`registered_nodes()` rows) as the planner sees them: with their liveness (Redis, read in bulk),
    the posted price of their device class, the memory their owners offer, and whether their owners' controls
    let them work now."""
    rows, now = list(rows), now or timezone.now()
    for row in rows:
        row["id"] = str(row["id"])
        row["device_class"] = device_class(row["flops_fp32"] or 0.0, row["memory_bytes"] or 0)
    liveness = leases_read({row["id"]: row["lease__renewed_at"] for row in rows}, now)
    prices = {klass: price_in_force(klass) for klass in {row["device_class"] for row in rows}}
    neighbour_links = nodes_worst_neighbour_link((row["id"] for row in rows), now)
    return tuple(
        _node_view(row, liveness[row["id"]], prices[row["device_class"]], now, neighbour_links.get(row["id"]))
        for row in rows
    )


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
        flops=row["flops_fp32"] or 0.0,
        memory_bytes=memory,
        paused=reason is not None,
        pause_reason=reason or "",
        device_type=row["device_type"] or "cpu",
        price_per_hour=price_per_hour,
        bandwidth_bytes_per_s=bandwidth or math.inf,
        latency_s=(rtt or 0.0) / 2,  # one way
        relayed=row["reachability"] == Reachability.RELAYED,
    )


def _job_view(job: Job) -> JobView:
    try:
        layers, spec_error = layer_profiles(model_spec_from_config(job.model_config)), None
    except SpecError as exc:  # validated at submit, but the library may have tightened since
        layers, spec_error = (), f"{exc.field}: {exc.message}"
    return JobView(
        id=str(job.id),
        status=job.status,
        generation=job.generation,
        stages_requested=job.stages_requested,
        layers=layers,
        workload=workload(job.dataset_config, job.micro_batches, job.schedule),
        requirements=requirements(job.requirements),
        stages=tuple(
            PlacedStage(
                index=s.index,
                layer_start=s.layer_start,
                layer_end=s.layer_end,
                node_id=str(s.node_id) if s.node_id else None,
                generation=s.generation,
                rank=s.rank,
            )
            for s in job.stages.all()
        ),
        conditions=tuple(job.conditions),
        driver_lease_expires_at=job.driver_lease_expires_at,
        driver_claimed=bool(job.driver_lease_owner),
        spec_error=spec_error,
        node_grace_seconds=job.node_grace_seconds,
        restarts=job.restarts,
        handover_requested=job.handover_requested,
        max_restarts=settings.ARCEUS_JOB_MAX_RESTARTS,
        tensor_parallel=tensor_parallel_split(job.tensor_parallel),
        serving=job.serving,
        served_layers=_final_checkpoint_layers(job) if job.serving and job.status == JobStatus.SUCCEEDED else (),
    )


def _final_checkpoint_layers(job: Job) -> tuple[tuple[int, int, int], ...]:
    """(index, layer_start, layer_end) of each stage of the job's newest checkpoint: what serving it places."""
    newest = job.checkpoints.order_by("-step").values("pk")[:1]
    return tuple(
        StageCheckpoint.objects.filter(checkpoint__in=newest)
        .order_by("stage_index")
        .values_list("stage_index", "layer_start", "layer_end")
    )
