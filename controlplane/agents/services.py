"""What a node's agent changes with its own requests: registration (a fresh process: a stage it hosted lost its
state), heartbeats (its lease, what it observed, its links; answered with its assignments) and leaving. Each reads
the stages the node hosts, so these sit above jobs; the node's own state is controlplane/nodes/services.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F

from arceus.contracts.observed import ObservedStage
from arceus.contracts.possession import key_sha256
from arceus.contracts.status import ACTIVE_STATUSES
from controlplane.common import metrics
from controlplane.common.conditions import TRUE
from controlplane.common.dispatch import reachability_check_soon, reconcile_soon
from controlplane.common.errors import ApplicationError
from controlplane.jobs.models import Stage
from controlplane.jobs.selectors import assignments_for_node, neighbour_nodes_by_address
from controlplane.jobs.selectors import assignments_version as assignments_version_of
from controlplane.jobs.stages import stages_record_observed
from controlplane.nodes.links import node_links_record
from controlplane.nodes.liveness import lease_renew
from controlplane.nodes.models import Node, NodeLease, NodeRestart, Reachability, ReadyStatus
from controlplane.nodes.services import node_flag, nodes_mark_ready


@transaction.atomic
def node_register(
    *,
    node: Node,
    grpc_address: str,
    device_type: str,
    device_name: str,
    memory_bytes: int,
    flops_fp32: float,
    now: datetime,
    tls_certificate: str,
    public_key: str = "",
    flops_fp16: float | None = None,
    flops_bf16: float | None = None,
    runtime_bytes: int = 0,
    link: dict[str, float] | None = None,
    metrics_port: int | None = None,
    lan_address: str = "",
    public_ip: str | None = None,
    exchange_port: int | None = None,
    exchange_address: str = "",
    data_plane: Sequence[str] = (),
) -> Node:
    """Record the agent's addresses and capabilities (inputs already validated by the API); `public_ip`: where the
    registration came from (agents behind the same one dial each other at their `lan_address`); `exchange_address`:
    where siblings dial its replicas' exchange listener as the agent advertised it, else the host of `grpc_address`
    at `exchange_port`; `data_plane`: the data-plane features it declared (arceus.contracts.data_plane, sorted),
    which its assignments name to it and to its neighbours.

    A registering agent is a fresh process: a stage it hosted lost its state (`_node_restarted`). The agent proved
    it holds the certificate's key (controlplane/nodes/possession.py); a key another node registered is a 409.
    """
    key = key_sha256(tls_certificate)
    if Node.objects.filter(tls_key_sha256=key).exclude(pk=node.pk).exists():
        raise ApplicationError.conflict(
            "tls_certificate: its key is registered by another node; each node's agent needs its own key (leave "
            "--tls-key-file out and the agent makes one)"
        )
    hosted = Stage.objects.filter(node=node, active=True).select_related("job").first()  # one at most
    if hosted is not None:
        _node_restarted(node=node, stage=hosted, now=now)
    node.grpc_address, node.metrics_port = grpc_address, metrics_port
    if not exchange_address and exchange_port is not None:
        exchange_address = f"{grpc_address.rpartition(':')[0]}:{exchange_port}"
    node.exchange_address = exchange_address
    node.lan_address, node.public_ip = lan_address, public_ip
    # A neighbour's assignment names these only from its next generation on, as it does the certificate: a node that
    # registers again while hosting rewinds its job.
    node.data_plane = list(data_plane)
    node.device_type = device_type
    node.device_name = device_name
    node.memory_bytes = memory_bytes
    node.runtime_memory_bytes = runtime_bytes
    node.flops_fp32 = flops_fp32
    node.flops_fp16, node.flops_bf16 = flops_fp16, flops_bf16
    node.public_key = public_key  # a new process has a new key: older receipts verify only against the old
    node.tls_certificate, node.tls_key_sha256 = tls_certificate, key
    if link is not None:
        _set_link(node, link, now)
    node.registered_at = now
    node.leaving_at = None  # a process that registers stays
    node.reachability, node.exchange_reachable = Reachability.UNKNOWN, None  # until the dial-back below answers
    node.ready_status = ReadyStatus.UNKNOWN
    node.ready_reason = "Registered"
    node.ready_message = "registered; waiting for the first heartbeat"
    node.ready_transition_at = now
    node.save()
    # The lease's floor and duration; heartbeats renew it in Redis only (controlplane.nodes.liveness).
    NodeLease.objects.update_or_create(
        node=node, defaults={"renewed_at": now, "duration_seconds": settings.ARCEUS_NODE_GRACE_SECONDS}
    )
    lease_renew(node_id=node.pk, now=now)
    reachability_check_soon()
    return node


@dataclass(frozen=True)
class HeartbeatAnswer:
    assignments_version: str
    assignments: list[dict[str, Any]] | None  # None: unchanged from the version the agent holds
    step_grants: dict[str, int]  # job id → the last training step its agents may run


@metrics.HEARTBEAT_SECONDS.time()
def node_heartbeat(
    *,
    node: Node,
    observed: Sequence[ObservedStage],
    now: datetime,
    host_busy_fraction: float | None = None,
    link: dict[str, float] | None = None,
    neighbour_links: Sequence[dict[str, Any]] = (),
    assignments_version: str | None = None,
) -> HeartbeatAnswer:
    """Renew the node's lease, record what it observed, and answer its assignments (its whole desired state)
    unless they are still the version the agent holds. A heartbeat that changes nothing writes nothing to the
    database: its lease goes to Redis (`controlplane.nodes.liveness`), and it costs one indexed read for the
    version and its jobs' step grants. Nudges the reconciler only when something changed."""
    if not node.is_registered:
        raise ApplicationError.conflict(
            f"node {node.id} has not registered; POST /api/agent/register before heartbeating"
        )
    lease_renew(node_id=node.pk, now=now, host_busy_fraction=host_busy_fraction)
    metrics.HEARTBEATS.inc()
    changed = False
    if link is not None:  # the agent re-measures its link every few minutes
        _set_link(node, link, now)
        node.save(update_fields=["control_plane_rtt_seconds", "control_plane_bandwidth_bytes_per_second",
                                 "link_measured_at"])
    if neighbour_links:
        node_links_record(node=node, links=neighbour_links, neighbours=neighbour_nodes_by_address(node=node), now=now)
    if observed:
        changed = stages_record_observed(node=node, reports=observed)
    if node.ready_status != TRUE:
        nodes_mark_ready(node_ids=[node.pk], now=now)
    if changed:
        reconcile_soon()
    hosted = assignments_version_of(node=node)
    if hosted.version == assignments_version:
        return HeartbeatAnswer(hosted.version, None, hosted.step_grants)
    return HeartbeatAnswer(hosted.version, assignments_for_node(node=node), hosted.step_grants)


@transaction.atomic
def node_leave(*, node: Node, now: datetime) -> int:
    """The node's agent is shutting down (SIGTERM): drain the node like a paused one, so the driver
    checkpoints where it is and its stage moves without losing work, until the agent registers again.
    Returns how many stages the node still hosts (the agent waits until its assignments no longer hold one)."""
    if Node.objects.filter(pk=node.pk, leaving_at__isnull=True).update(leaving_at=now):
        node.leaving_at = now
        reconcile_soon()
    return Stage.objects.filter(node=node, active=True).count()


def _node_restarted(*, node: Node, stage: Stage, now: datetime) -> None:
    """The node's agent came back as a fresh process while hosting `stage`: recorded on the stage
    (`restarted_generation`), from which the reconciler rewinds its job to its last checkpoint as a restart, the
    node losing its credit for the lost steps. And an agent that restarts again and again, across jobs (to make
    them replay steps), is flagged once it restarted more than ARCEUS_NODE_MAX_RESTARTS times within
    ARCEUS_NODE_RESTART_WINDOW_SECONDS; its stage then moves away. A restart of an idle node costs nobody anything
    and is not counted."""
    NodeRestart.objects.create(node=node, job=stage.job, stage_index=stage.index, restarted_at=now)
    window = settings.ARCEUS_NODE_RESTART_WINDOW_SECONDS
    since = now - timedelta(seconds=window)
    if node.flag_cleared_at is not None:
        since = max(since, node.flag_cleared_at)
    count = NodeRestart.objects.filter(node=node, restarted_at__gt=since).count()
    if count > settings.ARCEUS_NODE_MAX_RESTARTS:
        node_flag(
            node=node,
            reason=f"restarted {count} times while hosting a stage within {window:g} s "
            f"(ARCEUS_NODE_MAX_RESTARTS allows {settings.ARCEUS_NODE_MAX_RESTARTS})",
            now=now,
        )
    if stage.job.status in ACTIVE_STATUSES:  # a served stage is rebuilt from the same final checkpoint
        Stage.objects.filter(pk=stage.pk).update(restarted_generation=F("generation"))
        reconcile_soon()


def _set_link(node: Node, link: dict[str, float], now: datetime) -> None:
    node.control_plane_rtt_seconds = link["rtt_seconds"]
    node.control_plane_bandwidth_bytes_per_second = link["bandwidth_bytes_per_second"]
    node.link_measured_at = now
