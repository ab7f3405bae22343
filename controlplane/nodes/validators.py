from __future__ import annotations

import ipaddress
import re

from django.core.exceptions import ValidationError

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_WILDCARDS = {"0.0.0.0", "::"}


def validate_grpc_address(value: str) -> None:
    """A "host:port" (or "[v6]:port") other nodes can dial; a wildcard host is not such an address."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValidationError(f"Must be HOST:PORT with a port in 1..65535 (e.g. 10.0.0.5:50051), got {value!r}.")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        valid = _is_ip(host, version=6)
    else:
        valid = _is_ip(host, version=4) or bool(_HOSTNAME.match(host))
    if not valid:
        raise ValidationError(f"{host!r} is not a hostname or IP address (IPv6 goes in brackets: [::1]:50051).")
    if host in _WILDCARDS:
        raise ValidationError(
            f"{host} is a listen-everywhere address, not one other nodes can dial; advertise this "
            "machine's reachable address instead."
        )


def _is_ip(host: str, *, version: int) -> bool:
    try:
        return ipaddress.ip_address(host).version == version
    except ValueError:
        return False


def validate_lan_address(value: str) -> None:
    """An "IP:port" on a private network (10/8, 172.16/12, 192.168/16, fc00::/7, link-local): what an agent
    reports as its LAN address, which only agents behind the same public address are handed."""
    validate_grpc_address(value)
    host = value.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValidationError(f"{host!r} is not an IP address: a LAN address is the agent's private IP.") from None
    if ip.is_loopback or ip.is_unspecified or not (ip.is_private or ip.is_link_local):
        raise ValidationError(f"{host} is not a private network address (10.x, 172.16-31.x, 192.168.x, fc00::/7, "
                              "link-local); leave lan_address out when the agent has none.")
