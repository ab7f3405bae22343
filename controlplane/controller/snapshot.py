"""Reads the reconciler's view of the world from the database into plain snapshots."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.db.models import Prefetch, QuerySet
from django.utils import timezone

from arceus.contracts.status import ACTIVE_STATUSES, JobStatus
from arceus.errors import SpecError
from arceus.model.registry import model_spec_from_config
from arceus.placement.profiles import layer_profiles
from controlplane.controller.placement import requirements, tensor_parallel_split, workload
from controlplane.controller.rules import Desired, JobView, NodeView, Observed, PlacedStage, StageReport
from controlplane.jobs.models import Job, Stage
from controlplane.market.services import node_device_class, price_in_force
from controlplane.nodes.links import nodes_worst_neighbour_link
from controlplane.nodes.liveness import Liveness, leases_read
from controlplane.nodes.models import Node
from controlplane.nodes.selectors import node_unavailable_reason


def load_snapshot(now: datetime | None = None) -> tuple[Desired, Observed]:
    """Everything one reconcile pass decides from; `now` is when the owners' working hours are judged."""
    nodes = node_views(registered_nodes(), now)
    jobs = (
        Job.objects.filter(status__in=(JobStatus.QUEUED, *ACTIVE_STATUSES))
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


def registered_nodes() -> QuerySet[Node]:
    """Registered nodes with the fields the planner reads (deferring the certificate and key, which it never
    does: with 10,000 nodes they are most of the bytes)."""
    return (
        Node.objects.filter(registered_at__isnull=False, lease__isnull=False)
        .select_related("lease")
        .defer("tls_certificate", "public_key", "ready_message", "flag_clear_reason", "device_name")
    )


def node_views(nodes: Iterable[Node], now: datetime | None = None) -> tuple[NodeView, ...]:
    """Nodes as the planner sees them: with their liveness (Redis, read in bulk), the posted price of their
    device class, the memory their owners offer, and whether their owners' controls let them work now."""
    nodes, now = list(nodes), now or timezone.now()
    liveness = leases_read({str(n.id): n.lease.renewed_at for n in nodes}, now)
    prices = {klass: price_in_force(klass) for klass in {node_device_class(n) for n in nodes}}
    neighbour_links = nodes_worst_neighbour_link((n.id for n in nodes), now)
    return tuple(
        _node_view(node, liveness[str(node.id)], prices[node_device_class(node)], now,
                   neighbour_links.get(str(node.id)))
        for node in nodes
    )


def _node_view(
    node: Node, liveness: Liveness, price_per_hour: float, now: datetime,
    neighbour_link: tuple[float, float] | None,
) -> NodeView:
    reason = node_unavailable_reason(node, now, liveness.host_busy_fraction)
    offered = min(node.memory_bytes or 0, node.max_memory_bytes or node.memory_bytes or 0)
    memory = max(0, offered - node.runtime_memory_bytes)  # what stages may use beside the agent's own
    # The worst link it measured to a pipeline neighbour, else its link to the control plane.
    bandwidth, rtt = neighbour_link or (node.control_plane_bandwidth_bytes_per_second, node.control_plane_rtt_seconds)
    return NodeView(
        id=str(node.id),
        name=node.name,
        ready_status=node.ready_status,
        lease_renewed_at=liveness.renewed_at,
        lease_duration_seconds=node.lease.duration_seconds,
        flops=node.flops_fp32 or 0.0,
        memory_bytes=memory,
        paused=reason is not None,
        pause_reason=reason or "",
        device_type=node.device_type or "cpu",
        price_per_hour=price_per_hour,
        bandwidth_bytes_per_s=bandwidth or math.inf,
        latency_s=(rtt or 0.0) / 2,  # one way
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
        workload=workload(job.dataset_config, job.micro_batches),
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
    )
