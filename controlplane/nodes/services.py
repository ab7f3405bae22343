"""Nodes: minting, agent registration and heartbeats."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F

from arceus.contracts.credentials import token_digest
from arceus.contracts.observed import ObservedStage
from arceus.contracts.possession import key_sha256
from arceus.contracts.status import ACTIVE_STATUSES
from controlplane.common import metrics
from controlplane.common.conditions import TRUE
from controlplane.common.dispatch import reachability_check_soon, reconcile_soon
from controlplane.common.errors import ApplicationError
from controlplane.jobs.models import Stage
from controlplane.jobs.selectors import assignments_for_node
from controlplane.jobs.selectors import assignments_version as assignments_version_of
from controlplane.jobs.stages import stages_record_observed
from controlplane.nodes.links import node_links_record
from controlplane.nodes.liveness import lease_renew
from controlplane.nodes.models import Node, NodeLease, NodeRestart, Reachability, ReadyStatus

NODE_TOKEN_PREFIX = "arceus_node_"


def node_token_hash(token: str) -> str:
    """What a node's row keeps of its agent token (the token itself is shown once and never stored)."""
    return token_digest(token)


def _node_token_new() -> str:
    # The prefix makes tokens recognisable to secret scanners, and keeps a token from starting with "-",
    # which a command line (`--token -abc...`) would read as an option.
    return NODE_TOKEN_PREFIX + secrets.token_urlsafe(32)


def node_create(*, owner: AbstractBaseUser, name: str) -> tuple[Node, str]:
    """A new node and its agent token; only the token's hash is stored, so this is the one chance to
    see it."""
    token = _node_token_new()
    node = Node.objects.create(owner=owner, name=name, token_hash=node_token_hash(token))
    return node, token


@transaction.atomic
def node_token_rotate(*, node: Node, user: AbstractBaseUser) -> str:
    """A new agent token for the owner's node (shown once, like the first); the old one stops authenticating
    the agent API when this commits. An agent still running with the old token is refused from its next
    heartbeat on, and the node is lost after its grace period until the agent is restarted with the new one."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.owner_id != user.pk:
        raise ApplicationError.forbidden(f"node {node.id} belongs to another user; only its owner can rotate its token")
    token = _node_token_new()
    node.token_hash = node_token_hash(token)
    node.save(update_fields=["token_hash"])
    return token


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
) -> Node:
    """Record the agent's addresses and capabilities (inputs already validated by the API); `public_ip`: where the
    registration came from (agents behind the same one dial each other at their `lan_address`).

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
    node.lan_address, node.public_ip = lan_address, public_ip
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
    node.reachability = Reachability.UNKNOWN  # until the dial-back below answers
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
    version. Nudges the reconciler only when something changed."""
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
        node_links_record(node=node, links=neighbour_links, now=now)
    if observed:
        changed = stages_record_observed(node=node, reports=observed)
    if node.ready_status != TRUE:
        nodes_mark_ready(node_ids=[node.pk], now=now)
    if changed:
        reconcile_soon()
    version = assignments_version_of(node=node)
    if version == assignments_version:
        return HeartbeatAnswer(version, None)
    return HeartbeatAnswer(version, assignments_for_node(node=node))


def nodes_mark_ready(*, node_ids: Sequence[object], now: datetime) -> int:
    """Ready for these registered nodes, whose agents heartbeat: the ones not Ready yet change (the others keep
    their transition time), and the reconciler is nudged when any did. How many changed. Both heartbeat paths
    call it (`node_heartbeat`, and the quiet one for many nodes at once: controlplane/nodes/heartbeat.py)."""
    changed = (
        Node.objects.filter(pk__in=node_ids, registered_at__isnull=False)
        .exclude(ready_status=ReadyStatus.TRUE)
        .update(ready_status=ReadyStatus.TRUE, ready_reason="AgentReady",
                ready_message="the node agent is heartbeating", ready_transition_at=now)
    )
    if changed:
        metrics.NODE_READY_TRANSITIONS.labels(ready=TRUE).inc(changed)
        reconcile_soon()
    return changed


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


def node_flag(*, node: Node, reason: str, now: datetime) -> bool:
    """Flag the node (a spot check caught its work wrong, or its agent restarts too often): it takes no new
    stage and the stages it hosts move away, like a paused node's. The first reason is kept. Returns whether
    it was newly flagged."""
    flagged = Node.objects.filter(pk=node.pk, flagged_at__isnull=True).update(flagged_at=now, flag_reason=reason)
    if flagged:
        node.flagged_at, node.flag_reason = now, reason
        reconcile_soon()
    return bool(flagged)


@transaction.atomic
def node_flag_clear(*, node: Node, now: datetime, reason: str, by: AbstractBaseUser | None = None) -> bool:
    """An operator's decision that the flagged node may work again: it can be placed on again, and its
    restarts so far no longer count towards a new flag. Withheld credit stays withheld. The operator and
    their reason are recorded with the flag it replaces. Returns whether the node was flagged."""
    reason = reason.strip()
    if not reason:
        raise ApplicationError.invalid("reason", "say why the node may work again (it is recorded on the node)")
    flagged = Node.objects.select_for_update().filter(pk=node.pk, flagged_at__isnull=False).first()
    if flagged is None:
        return False
    record = f"{flagged.flag_reason} -- cleared: {reason}"
    Node.objects.filter(pk=node.pk).update(
        flagged_at=None, flag_reason="", flag_cleared_at=now, flag_clear_reason=record, flag_cleared_by=by
    )
    node.flagged_at, node.flag_reason, node.flag_cleared_at = None, "", now
    node.flag_clear_reason, node.flag_cleared_by = record, by
    reconcile_soon()
    return True


@transaction.atomic
def node_set_paused(*, node: Node, user: AbstractBaseUser, paused: bool, now: datetime) -> Node:
    """Pause (drain) or resume the node. A paused node gets no new stage; a stage it hosts is handed back:
    a running job checkpoints where it is and the stage moves to another node, so no work is lost. Only
    the node's owner, or an operator (staff, through the admin), may do this."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.owner_id != user.pk and not user.is_staff:
        raise ApplicationError.forbidden(f"node {node.id} belongs to another user; only its owner can pause it")
    if node.paused != paused:
        node.paused, node.paused_at = paused, now if paused else None
        node.save(update_fields=["paused", "paused_at"])
        reconcile_soon()
    return node


@transaction.atomic
def node_leave(*, node: Node, now: datetime) -> int:
    """The node's agent is shutting down (SIGTERM): drain the node like a paused one, so the driver
    checkpoints where it is and its stage moves without losing work, until the agent registers again.
    Returns how many stages the node still hosts (the agent waits until its assignments no longer hold one)."""
    if Node.objects.filter(pk=node.pk, leaving_at__isnull=True).update(leaving_at=now):
        node.leaving_at = now
        reconcile_soon()
    return Stage.objects.filter(node=node, active=True).count()


@transaction.atomic
def node_set_controls(*, node: Node, user: AbstractBaseUser, controls: dict[str, Any]) -> Node:
    """Replace the owner's controls (working hours, idle-only, memory and thread caps); validated by the
    API. Outside its working hours, or while its owner is busy with an idle-only node, the node drains
    like a paused one."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.owner_id != user.pk:
        raise ApplicationError.forbidden(f"node {node.id} belongs to another user; only its owner can change it")
    for field, value in controls.items():
        setattr(node, field, value)
    node.save(update_fields=list(controls))
    reconcile_soon()
    return node
