"""Nodes' measured links to their pipeline neighbours: recorded from heartbeats, read by placement."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Max, Min

from controlplane.nodes.models import Node, NodeLink


def node_links_record(
    *, node: Node, links: Sequence[dict[str, Any]], neighbours: Mapping[str, Any], now: datetime
) -> None:
    """Upsert the figures of `node`'s links (validated by the API, keyed by the neighbour's gRPC address).
    Only the addresses in `neighbours` count (dialled address -> node id of each node hosting a neighbour of one of
    its active stages: controlplane/jobs/selectors.py `neighbour_nodes_by_address`), so a report that raced a move
    names no stale node. Null figures (the probe failed) drop the pair's figures: unknown."""
    measured, unknown = [], []
    for link in links:
        peer = neighbours.get(link["address"])
        if peer is None:
            continue
        if link["rtt_seconds"] is None:
            unknown.append(peer)
        else:
            measured.append(
                NodeLink(from_node=node, to_node_id=peer, rtt_seconds=link["rtt_seconds"],
                         bandwidth_bytes_per_second=link["bandwidth_bytes_per_second"], measured_at=now)
            )
    if unknown:
        NodeLink.objects.filter(from_node=node, to_node_id__in=unknown).delete()
    if measured:
        NodeLink.objects.bulk_create(
            measured, update_conflicts=True, unique_fields=["from_node", "to_node"],
            update_fields=["rtt_seconds", "bandwidth_bytes_per_second", "measured_at"],
        )


def nodes_worst_neighbour_link(node_ids: Iterable[Any] | None, now: datetime) -> dict[str, tuple[float, float]]:
    """Node id → (lowest bandwidth, highest RTT) among its fresh neighbour-link figures (measured within
    ARCEUS_NEIGHBOUR_LINK_MAX_AGE_SECONDS); nodes with none are left out. `node_ids` None: every node's (the
    reconciler's: no list of 10,000 ids to send)."""
    since = now - timedelta(seconds=settings.ARCEUS_NEIGHBOUR_LINK_MAX_AGE_SECONDS)
    links = NodeLink.objects.filter(measured_at__gte=since)
    if node_ids is not None:
        links = links.filter(from_node_id__in=list(node_ids))
    rows = links.values("from_node_id").annotate(bandwidth=Min("bandwidth_bytes_per_second"), rtt=Max("rtt_seconds"))
    return {str(r["from_node_id"]): (r["bandwidth"], r["rtt"]) for r in rows}
