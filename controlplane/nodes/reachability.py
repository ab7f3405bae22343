"""Reachability, measured: after a registration the control plane dials the agent back at the address it
registered (TLS pinned to its registered certificate; its health check, which needs no token) and records
`direct` or `relayed` (callers then reach it through a relay: controlplane/nodes/relays.py). A direct node that
registered an exchange address is dialled there too (a TLS handshake pinned to the same certificate): siblings dial
its replicas' exchange listener there, so where it does not answer (a port not forwarded, a firewall) the node hosts
no replica of a stage (`Node.exchange_reachable`). A relayed node's siblings reach its listener through its relay.

Dial-backs are sweeps, not one task per registration: a registration marks its node `unknown` and nudges a sweep
(coalesced, on the `reachability` queue and worker, never ahead of the reconcile passes), and a sweep dials every
`unknown` node, many at once (`arceus.wire.channels.agents_answering`). An agent behind a router that drops the
dial costs a whole timeout; 10,000 of them dialled one by one on the control queue held placement up for hours.
The sweep speaks gRPC: only the reachability worker imports it (`-I tasks.nodes`).
"""

from __future__ import annotations

import functools
import operator
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from arceus.wire.channels import agents_answering, exchanges_answering
from controlplane.common.dispatch import reachability_check_soon, reconcile_soon
from controlplane.nodes.models import Node, Reachability


def nodes_check_reachability() -> dict[str, int]:
    """Dial back up to ARCEUS_REACHABILITY_BATCH nodes whose reachability is unknown (oldest registration first)
    and record what was found. A node that registered again meanwhile keeps `unknown` (the next sweep dials its new
    address). Nudges another sweep when more wait, and the reconciler when anything was recorded. Returns the counts
    recorded by reachability."""
    rows = list(
        Node.objects.filter(reachability=Reachability.UNKNOWN, registered_at__isnull=False)
        .order_by("registered_at")
        .values_list("id", "grpc_address", "tls_certificate", "registered_at", "exchange_address")
        [: settings.ARCEUS_REACHABILITY_BATCH]
    )
    dial = {"timeout": settings.ARCEUS_REACHABILITY_TIMEOUT_SECONDS,
            "concurrency": settings.ARCEUS_REACHABILITY_CONCURRENCY}
    answers = agents_answering([(address, certificate) for _, address, certificate, *_ in rows], **dial)
    found: dict[str, list[tuple[object, datetime]]] = {Reachability.DIRECT: [], Reachability.RELAYED: []}
    answered_at: set[str] = set()
    for (node_id, address, _, registered_at, _), answered in zip(rows, answers, strict=True):
        found[Reachability.DIRECT if answered else Reachability.RELAYED].append((node_id, registered_at))
        if answered:
            answered_at.add(address)
    # Where the agent answered directly, its siblings dial its exchange listener at the address it registered too
    # (a relayed node's they reach through its relay): a node whose listener is not there hosts no replica.
    listeners = [(node_id, registered_at, exchange, certificate)
                 for (node_id, _, certificate, registered_at, exchange), answered in zip(rows, answers, strict=True)
                 if answered and exchange]
    exchanges = exchanges_answering([(exchange, certificate) for *_, exchange, certificate in listeners], **dial)
    exchanged: dict[bool, list[tuple[object, datetime]]] = {True: [], False: []}
    for (node_id, registered_at, *_), answered in zip(listeners, exchanges, strict=True):
        exchanged[answered].append((node_id, registered_at))
    counts, now = {}, timezone.now()
    with transaction.atomic():
        for reachability, nodes in found.items():
            counts[reachability] = sum(
                Node.objects.filter(_any_of(chunk)).update(reachability=reachability, reachability_checked_at=now,
                                                           exchange_reachable=None)
                for chunk in _chunks(nodes, 500)
            )
        for reachable, nodes in exchanged.items():
            for chunk in _chunks(nodes, 500):
                Node.objects.filter(_any_of(chunk)).update(exchange_reachable=reachable)
        # An address answers for one node at a time: the key that answered there now is the newest node's, so any
        # other node found direct there before is dialled again (its own key no longer answers: relayed).
        counts[Reachability.UNKNOWN] = Node.objects.filter(
            grpc_address__in=answered_at, reachability=Reachability.DIRECT
        ).exclude(pk__in=[node_id for node_id, _ in found[Reachability.DIRECT]]).update(
            reachability=Reachability.UNKNOWN
        )
        if any(counts.values()):
            reconcile_soon()  # its stages' neighbours now dial it elsewhere
        if len(rows) == settings.ARCEUS_REACHABILITY_BATCH or counts[Reachability.UNKNOWN]:
            reachability_check_soon()
    return counts


def _any_of(nodes: list[tuple[object, datetime]]) -> Q:
    # Guarded by the registration it dialled: a node that registered since waits for the next sweep.
    return functools.reduce(operator.or_, (Q(pk=node_id, registered_at=at) for node_id, at in nodes))


def _chunks(items: list[tuple[object, datetime]], size: int) -> list[list[tuple[object, datetime]]]:
    return [items[i:i + size] for i in range(0, len(items), size)]
