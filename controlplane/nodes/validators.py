from __future__ import annotations

import ipaddress

from django.core.exceptions import ValidationError

from controlplane.nodes.addresses import grpc_address_problem


def validate_grpc_address(value: str) -> None:
    """A "host:port" (or "[v6]:port") other nodes can dial (`controlplane.nodes.addresses`)."""
    if problem := grpc_address_problem(value):
        raise ValidationError(problem)


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
