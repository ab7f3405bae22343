"""Nodes' assignments built ahead, when a reconcile pass changed them, for the quiet heartbeat to answer.

A pass that places jobs changes many nodes' assignments, and each of their agents' next heartbeat must carry
them. Built by Django in the web server's threads, they queued behind each other and took the interpreter from the
event loop that answers every other heartbeat (docs/BENCHMARKS.md, "Figures moved from docs/architecture.md"). So
the control worker builds them right after the pass (tasks/control.py; `assignments_prepare`: five queries for all
of a pass's nodes) and stores each node's under the version it was built at; the quiet heartbeat
(controlplane/agents/heartbeat.py) reads the version anyway, and answers the assignments stored under it in one
more Redis round trip. When none are stored (expired, not built yet, or the version moved on since), Django builds
them as before: this only moves work, it never decides an answer.

An answer is stored under a version only when the version read before building it and the one read after are the
same, so the stored assignments are those of that version (a generation only grows, so a version does not come
back). Redis already holds what the control plane trusts as it trusts its database (the broker's messages, the
leases); these entries hold what the node's own heartbeat answer holds, and expire.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from controlplane.common.redis_client import async_redis_client, redis_client
from controlplane.jobs.selectors import assignments_for_nodes, assignments_versions
from controlplane.nodes.models import Node

KEY = "arceus:assignments:{node_id}:{version}"
# Long enough for an agent backing off (30 s at most) to come back for them; short enough that nobody's are kept.
TTL_SECONDS = 300


def assignments_prepare(*, job_ids: Collection[str]) -> int:
    """Build and store the assignments of every node hosting an active stage of these jobs (all of its stages',
    not only these jobs'); how many were stored."""
    nodes = list(Node.objects.filter(stages__job_id__in=list(job_ids), stages__active=True).distinct())
    node_ids = [node.pk for node in nodes]
    versions = assignments_versions(node_ids=node_ids)
    built = assignments_for_nodes(nodes=nodes)
    unchanged = assignments_versions(node_ids=node_ids)
    pipe = redis_client().pipeline(transaction=False)
    for node_id, version in versions.items():
        if unchanged[node_id] == version:  # else changed while built: its next heartbeat goes to Django
            pipe.set(KEY.format(node_id=node_id, version=version), json.dumps(built[node_id]), ex=TTL_SECONDS)
    return sum(map(bool, pipe.execute()))


async def prepared_assignments_read(keys: list[tuple[str, str]]) -> list[list[dict] | None]:
    """The assignments stored for each (node id, version), or None, in one round trip on the running event loop's
    client."""
    stored = await async_redis_client().mget([KEY.format(node_id=n, version=v) for n, v in keys])
    return [None if raw is None else json.loads(raw) for raw in stored]
