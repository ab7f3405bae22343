"""Where a relayed agent is dialled: a name that resolves nowhere (RFC 6761 `.invalid`) and that only the relay
dialer (arceus.relay.dialer) understands, so it stays the same whichever relay the agent is attached to; its port
names the agent's listener reached (`LISTENER_PORTS`: its gRPC server, or its replicas' exchange listener); and the
order in which callers and the control plane try the relays for one node (rendezvous hashing)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

RELAYED_DOMAIN = "relayed.invalid"
_SUFFIX = "." + RELAYED_DOMAIN
GRPC, EXCHANGE = "grpc", "exchange"  # the agent's listeners a relay splices onto (relay.proto's Listener)
LISTENER_PORTS = {1: GRPC, 2: EXCHANGE}  # a relayed address's port: which listener (never dialled as a port)


def relayed_address(node_id: str, listener: str = GRPC) -> str:
    """The address callers dial to reach node `node_id`'s `listener` through a relay."""
    port = next(p for p, name in LISTENER_PORTS.items() if name == listener)
    return f"{node_id}{_SUFFIX}:{port}"


def relayed_listener(address: str) -> str | None:
    """The listener a relayed address names; None for an address that names none."""
    port = address.rpartition(":")[2]
    return LISTENER_PORTS.get(int(port)) if port.isdigit() and relayed_node(address) is not None else None


def relayed_node(address: str) -> str | None:
    """The node id a relayed address names; None for any other address."""
    host = address.rpartition(":")[0]
    return host[: -len(_SUFFIX)] if host.endswith(_SUFFIX) and len(host) > len(_SUFFIX) else None


def relay_order(node_id: str, relays: Iterable[str]) -> list[str]:
    """`relays` in this node's preference order: each relay gets its share of the nodes, and removing one moves
    only the nodes it held."""
    return sorted(set(relays), key=lambda relay: hashlib.sha256(f"{node_id}|{relay}".encode()).digest())
