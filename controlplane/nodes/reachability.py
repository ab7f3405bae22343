"""Reachability, measured: after each registration the control plane dials the agent back at the address it
registered (TLS pinned to its registered certificate; its health check, which needs no token) and records
`direct` or `relayed` (callers then reach it through a relay: controlplane/nodes/relays.py)."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.utils import timezone

from arceus.wire.channels import agent_answers
from controlplane.common.dispatch import reconcile_soon
from controlplane.nodes.models import Node, Reachability


def node_check_reachability(*, node_id: str, registered_at: datetime) -> str | None:
    """Dial the node back and record what was found; None if it registered again since (that registration's own
    check decides)."""
    node = Node.objects.filter(pk=node_id, registered_at=registered_at).first()
    if node is None:
        return None
    answered = agent_answers(node.grpc_address, certificate=node.tls_certificate,
                             timeout=settings.ARCEUS_REACHABILITY_TIMEOUT_SECONDS)
    reachability = Reachability.DIRECT if answered else Reachability.RELAYED
    Node.objects.filter(pk=node_id, registered_at=registered_at).update(
        reachability=reachability, reachability_checked_at=timezone.now()
    )
    reconcile_soon()  # its stages' neighbours now dial it elsewhere
    return reachability
