"""Which relay a relayed node's agent attaches to (the operator's ARCEUS_RELAYS), told in its heartbeat answer
with a fresh ticket, and the relays' certificate everyone pins (ARCEUS_RELAY_CERTIFICATE_FILE). Pure: the agent
reports where it is attached and which relays failed it lately, so a relay that died is left out at the agent's
next heartbeat, and an agent stays where it is while that relay lives."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from arceus.contracts.certificates import RELAY_TLS_NAME, check_certificate
from arceus.relay.address import relay_order
from arceus.relay.tickets import check_secret, mint_ticket
from controlplane.nodes.models import Reachability


def relay_assignment(
    *, node_id: str, reachability: str, attached: str | None, failed: Sequence[str], now: float
) -> dict[str, Any] | None:
    """{"address", "ticket"} for a relayed node; None for a node dialled directly, or when no relay is configured.
    `failed` lists the longest-ago failure first: when every relay failed the agent lately, it tries that one."""
    relays = settings.ARCEUS_RELAYS
    if reachability != Reachability.RELAYED or not relays:
        return None
    if attached in relays and attached not in failed:
        chosen = attached
    else:
        chosen = next((r for r in relay_order(node_id, relays) if r not in failed), None)
        if chosen is None:
            chosen = next(r for r in failed if r in relays)
    return {"address": chosen, "ticket": mint_ticket(relay_secret(), node_id,
                                                     int(now + settings.ARCEUS_RELAY_TICKET_SECONDS))}


def relay_secret() -> bytes:
    try:
        return check_secret(settings.ARCEUS_RELAY_SECRET.encode())
    except ValueError as exc:
        raise ImproperlyConfigured(f"ARCEUS_RELAYS is set, so {exc}; give the relays the same one") from None


@cache
def relay_certificate() -> str:
    """The relays' certificate (PEM) when relays are configured, else ""; ImproperlyConfigured saying what to fix."""
    if not settings.ARCEUS_RELAYS:
        return ""
    path = settings.ARCEUS_RELAY_CERTIFICATE_FILE
    if not path:
        raise ImproperlyConfigured("ARCEUS_RELAYS is set, so ARCEUS_RELAY_CERTIFICATE_FILE must name the relays' "
                                   "certificate (python -m arceus.relay --new-identity makes it)")
    try:
        return check_certificate(Path(path).read_text(), RELAY_TLS_NAME)
    except (OSError, ValueError) as exc:
        raise ImproperlyConfigured(f"ARCEUS_RELAY_CERTIFICATE_FILE={path}: {exc}") from None
