"""Relay tickets: the control plane's word that an agent may attach to a relay as a node, until a time.

HMAC-SHA256 under the secret the operator gives the control plane and every relay (ARCEUS_RELAY_SECRET), so a
relay checks a ticket without a database. A ticket lets its holder receive the node's connections, never read
them: callers still check the agent's pinned TLS certificate end to end (docs/security.md)."""

from __future__ import annotations

import hashlib
import hmac

METADATA_KEY = "arceus-relay-ticket"
MIN_SECRET_BYTES = 16


class TicketError(ValueError):
    """A ticket that is malformed, forged or expired."""


def _mac(secret: bytes, node_id: str, expires_at: int) -> str:
    return hmac.new(secret, f"{node_id}.{expires_at}".encode(), hashlib.sha256).hexdigest()


def check_secret(secret: bytes) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the relay secret must be at least {MIN_SECRET_BYTES} bytes (ARCEUS_RELAY_SECRET)")
    return secret


def mint_ticket(secret: bytes, node_id: str, expires_at: int) -> str:
    """A ticket for `node_id`, valid until `expires_at` (Unix seconds)."""
    if "." in node_id or not node_id:
        raise ValueError(f"{node_id!r} is not a node id")
    return f"{node_id}.{expires_at}.{_mac(check_secret(secret), node_id, expires_at)}"


def verify_ticket(secret: bytes, ticket: str, now: float) -> str:
    """The node id `ticket` vouches for; TicketError if it does not verify or has expired."""
    node_id, _, rest = ticket.partition(".")
    expires, _, mac = rest.partition(".")
    if not node_id or not expires.isdigit() or len(mac) != 64:
        raise TicketError("a relay ticket is NODE.EXPIRES.MAC")
    if not hmac.compare_digest(mac, _mac(secret, node_id, int(expires))):
        raise TicketError("the relay ticket does not verify")
    if int(expires) < now:
        raise TicketError("the relay ticket has expired; the agent's next heartbeat brings a fresh one")
    return node_id
