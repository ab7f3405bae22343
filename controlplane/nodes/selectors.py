from __future__ import annotations

import uuid
from datetime import datetime

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Prefetch, QuerySet

from controlplane.common.errors import ApplicationError
from controlplane.jobs.models import Stage
from controlplane.nodes.availability import unavailable_reason
from controlplane.nodes.liveness import Liveness, lease_of
from controlplane.nodes.models import Node


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
    """The node with this token, and whether its owner is active (`owner_is_active`; `node.owner` itself loads
    on first use). Raw SQL: every agent request runs it (10,000 agents heartbeat 1,000 times a second), and
    composing the ORM's query cost more CPU than the rest of a heartbeat."""
    user = get_user_model()
    rows = Node.objects.raw(
        f"SELECT n.*, u.is_active AS owner_is_active FROM {Node._meta.db_table} n "  # noqa: S608 (names, not input)
        f"JOIN {user._meta.db_table} u ON u.{user._meta.pk.column} = n.owner_id WHERE n.token_hash = %s",
        [token_hash],
    )
    return next(iter(rows), None)


def node_liveness(node: Node) -> Liveness | None:
    """The node's last heartbeat and host load (Redis), None before it first registered; read once per instance
    (a page shows both)."""
    if not hasattr(node, "_liveness"):
        lease = getattr(node, "lease", None)
        node._liveness = lease_of(node.pk, lease.renewed_at) if lease is not None else None
    return node._liveness


def node_unavailable_reason(node: Node, now: datetime, host_busy_fraction: float | None = None) -> str | None:
    """Why the node may not work now by its owner's controls, or None (see nodes/availability.py)."""
    return unavailable_reason(
        paused=node.paused,
        flag_reason=node.flag_reason if node.flagged_at else None,
        leaving=node.leaving_at is not None,
        work_windows=node.work_windows,
        idle_only=node.idle_only,
        idle_cpu_threshold=node.idle_cpu_threshold,
        host_busy_fraction=host_busy_fraction,
        now=now,
    )
