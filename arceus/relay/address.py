"""Where a relayed agent is dialled: a name that resolves nowhere (RFC 6761 `.invalid`) and that only the relay
dialer (arceus.relay.dialer) understands, so it stays the same whichever relay the agent is attached to; and the
order in which callers and the control plane try the relays for one node (rendezvous hashing)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

RELAYED_DOMAIN = "relayed.invalid"
_SUFFIX = "." + RELAYED_DOMAIN


def relayed_address(node_id: str) -> str:
    """The address callers dial to reach node `node_id` through a relay (the port is never used)."""
    return f"{node_id}{_SUFFIX}:1"


def relayed_node(address: str) -> str | None:
    """The node id a relayed address names; None for any other address."""
    host = address.rpartition(":")[0]
    return host[: -len(_SUFFIX)] if host.endswith(_SUFFIX) and len(host) > len(_SUFFIX) else None


def relay_order(node_id: str, relays: Iterable[str]) -> list[str]:
    """`relays` in this node's preference order: each relay gets its share of the nodes, and removing one moves
    only the nodes it held."""
    return sorted(set(relays), key=lambda relay: hashlib.sha256(f"{node_id}|{relay}".encode()).digest())
