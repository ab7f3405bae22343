from __future__ import annotations

import uuid
from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Prefetch, QuerySet

from controlplane.common.errors import ApplicationError
from controlplane.jobs.models import Stage
from controlplane.nodes.availability import unavailable_reason
from controlplane.nodes.models import Node, ReadyStatus


def node_list_for_user(*, user: AbstractBaseUser) -> QuerySet[Node]:
    """The user's own nodes, with their leases and the stages they host: a node's address, certificate and
    current job are its owner's business (everyone sees the market's aggregates: GET /api/market/prices)."""
    return Node.objects.filter(owner=user).select_related("owner", "lease").prefetch_related(
        Prefetch("stages", queryset=Stage.objects.filter(active=True), to_attr="active_stages")
    )


def node_get_for_user(*, user: AbstractBaseUser, node_id: str) -> Node:
    """The user's node; 404 for a malformed id and for another user's node alike, so ids cannot be probed."""
    try:
        key = uuid.UUID(str(node_id))
    except ValueError:
        raise ApplicationError.not_found("node", node_id) from None
    node = node_list_for_user(user=user).filter(pk=key).first()
    if node is None:
        raise ApplicationError.not_found("node", node_id)
    return node


def node_by_token_hash(*, token_hash: str) -> Node | None:
    return Node.objects.select_related("owner").filter(token_hash=token_hash).first()


def node_status(node: Node, now: datetime) -> str:
    """One word for the owner: flagged, paused, unreachable (not Ready: silent, or never registered),
    draining (may not work now but still hosts a stage), training (hosts one), or ready. `node` as the
    node selectors return it (its lease and active stages fetched)."""
    if node.flagged_at:
        return "flagged"
    if node.paused:
        return "paused"
    if node.ready_status != ReadyStatus.TRUE:
        return "unreachable"
    hosting = bool(node.active_stages)
    if node_unavailable_reason(node, now) is not None:
        return "draining" if hosting else "paused"
    return "training" if hosting else "ready"


def node_unavailable_reason(node: Node, now: datetime) -> str | None:
    """Why the node may not work now by its owner's controls, or None (see nodes/availability.py)."""
    lease = getattr(node, "lease", None)
    return unavailable_reason(
        paused=node.paused,
        flag_reason=node.flag_reason if node.flagged_at else None,
        leaving=node.leaving_at is not None,
        work_windows=node.work_windows,
        idle_only=node.idle_only,
        idle_cpu_threshold=node.idle_cpu_threshold,
        host_busy_fraction=lease.host_busy_fraction if lease else None,
        now=now,
    )
