from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, F, FilteredRelation, Q, QuerySet

from arceus.contracts.scrape import SCRAPE_TOKEN_PARAMETER, agent_scrape_token
from controlplane.common.errors import one_by_id
from controlplane.nodes.availability import unavailable_reason
from controlplane.nodes.device_class import node_device_class
from controlplane.nodes.liveness import Liveness, lease_of, leases_read
from controlplane.nodes.models import Node, ReadyStatus

# A node whose agent has not heartbeated for this long is gone (uninstalled, or its owner moved on): Prometheus
# stops scraping it. Shorter outages stay targets, so the agents' "down" alert sees them.
METRICS_TARGET_GONE_AFTER = timedelta(minutes=10)


def node_list_for_user(*, user: AbstractBaseUser) -> QuerySet[Node]:
    """The user's own nodes, with their leases and the stage each hosts (`current_job_id`, `current_stage_index`,
    `current_rank`; None when idle): a node's address, certificate and current job are its owner's business
    (everyone sees the market's aggregates: GET /api/market/prices). The stage is read through the jobs app's
    foreign key to the node (a node hosts one active stage at most: `stage_one_active_per_node`), one join."""
    return (
        Node.objects.filter(owner=user)
        .select_related("owner", "lease")
        .annotate(hosted=FilteredRelation("stages", condition=Q(stages__active=True)))
        .annotate(current_job_id=F("hosted__job_id"), current_stage_index=F("hosted__index"),
                  current_rank=F("hosted__rank"))
    )


def node_get_for_user(*, user: AbstractBaseUser, node_id: str) -> Node:
    """The user's node; 404 for a malformed id and for another user's node alike, so ids cannot be probed."""
    return one_by_id(node_list_for_user(user=user), "node", node_id)


# What an agent request reads of its node (a heartbeat: nothing else); any other field loads when first used.
AGENT_REQUEST_FIELDS = ("id", "owner", "registered_at", "ready_status", "reachability", "max_threads",
                        "max_memory_bytes")


def node_by_token_hash(*, token_hash: str) -> Node | None:
    """The node with this token, and whether its owner is active (`owner_is_active`; `node.owner` itself loads
    on first use). Raw SQL: every agent request runs it (10,000 agents heartbeat 1,000 times a second), and
    composing the ORM's query cost more CPU than the rest of a heartbeat; and only AGENT_REQUEST_FIELDS, since
    decoding the node's forty columns cost as much again."""
    user = get_user_model()
    columns = ", ".join(f"n.{Node._meta.get_field(name).column}" for name in AGENT_REQUEST_FIELDS)
    rows = Node.objects.raw(
        f"SELECT {columns}, u.is_active AS owner_is_active FROM {Node._meta.db_table} n "  # noqa: S608 (names)
        f"JOIN {user._meta.db_table} u ON u.{user._meta.pk.column} = n.owner_id WHERE n.token_hash = %s",
        [token_hash],
    )
    return next(iter(rows), None)


def node_status(node: Node, now: datetime) -> str:
    """One word for the owner: flagged, paused, unreachable (not Ready: silent, or never registered),
    draining (may not work now but still hosts a stage), training (hosts one), or ready. `node` as the
    node selectors return it (its lease and hosted stage read)."""
    if node.flagged_at:
        return "flagged"
    if node.paused:
        return "paused"
    if node.ready_status != ReadyStatus.TRUE:
        return "unreachable"
    hosting = node.current_job_id is not None
    liveness = node_liveness(node)
    if node_unavailable_reason(node, now, liveness.host_busy_fraction if liveness else None) is not None:
        return "draining" if hosting else "paused"
    return "training" if hosting else "ready"


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


def node_metrics_targets(*, now: datetime) -> list[dict[str, Any]]:
    """Prometheus http_sd targets: each registered node's agent /metrics (the host of its gRPC address, the
    metrics port it registered), while it is not gone; labelled with the node's name, id and device class, and
    carrying the token that agent's /metrics wants (arceus/contracts/scrape.py): only while metrics
    are on (GET /metrics/agents refuses otherwise)."""
    registered = list(
        Node.objects.filter(registered_at__isnull=False, metrics_port__isnull=False, lease__isnull=False)
        .select_related("lease")
        .order_by("created_at")
    )
    live = leases_read({str(n.pk): n.lease.renewed_at for n in registered}, now)  # heartbeats are in Redis
    nodes = [n for n in registered if live[str(n.pk)].renewed_at >= now - METRICS_TARGET_GONE_AFTER]
    return [
        {
            "targets": [f"{node.grpc_address.rpartition(':')[0]}:{node.metrics_port}"],
            "labels": {
                "node": node.name, "node_id": str(node.id), "device_class": node_device_class(node),
                # What opens this agent's /metrics (a `__` label: a parameter of the scrape URL, never stored).
                f"__param_{SCRAPE_TOKEN_PARAMETER}": agent_scrape_token(settings.ARCEUS_METRICS_TOKEN, str(node.id)),
            },
        }
        for node in nodes
    ]


def node_counts() -> dict[str, dict[str, int]]:
    """How many nodes are in each Ready state ("NotRegistered" before their agent registered), and how many are
    held back from new work by each reason (paused, leaving, flagged; one node may have several)."""
    counts = Node.objects.aggregate(
        not_registered=Count("pk", filter=Q(registered_at__isnull=True)),
        **{
            status: Count("pk", filter=Q(registered_at__isnull=False, ready_status=status))
            for status in ReadyStatus.values
        },
        paused=Count("pk", filter=Q(paused=True)),
        leaving=Count("pk", filter=Q(leaving_at__isnull=False)),
        flagged=Count("pk", filter=Q(flagged_at__isnull=False)),
    )
    return {
        "ready": {"NotRegistered": counts["not_registered"], **{s: counts[s] for s in ReadyStatus.values}},
        "held_back": {reason: counts[reason] for reason in ("paused", "leaving", "flagged")},
    }
