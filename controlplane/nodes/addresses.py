"""What makes an address another node can dial ("host:port"), Django-free: the heartbeat schema reads it on the
event loop, `controlplane.nodes.validators` wraps it for Django's fields."""

from __future__ import annotations

import ipaddress
import re

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_WILDCARDS = {"0.0.0.0", "::"}


def grpc_address_problem(value: str) -> str | None:
    """Why `value` is not a "host:port" (or "[v6]:port") other nodes can dial; None when it is."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"Must be HOST:PORT with a port in 1..65535 (e.g. 10.0.0.5:50051), got {value!r}."
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        valid = is_ip(host, version=6)
    else:
        valid = is_ip(host, version=4) or bool(_HOSTNAME.match(host))
    if not valid:
        return f"{host!r} is not a hostname or IP address (IPv6 goes in brackets: [::1]:50051)."
    if host in _WILDCARDS:
        return (
            f"{host} is a listen-everywhere address, not one other nodes can dial; advertise this "
            "machine's reachable address instead."
        )
    return None


def is_ip(host: str, *, version: int) -> bool:
    try:
        return ipaddress.ip_address(host).version == version
    except ValueError:
        return False
