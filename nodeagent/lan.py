"""The agent's LAN address: the private IP this machine reaches the control plane from, with the agent's gRPC port.
Reported at registration; the control plane hands it to agents registering from the same public address, which
then dial this one across their LAN instead of through their router or a relay."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")  # listen hosts that mean every interface


def lan_address(control_plane_url: str, listen_host: str, port: int) -> str | None:
    """"IP:port" on this machine's private network, or None: no private address leads to the control plane (a
    public or loopback one does), or the agent listens on another interface than that one."""
    host = urlsplit(control_plane_url).hostname
    if not host:
        return None
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 443, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address[:2])  # a UDP "connection" picks the route and sends nothing
            local = probe.getsockname()[0]
    except OSError:
        return None
    ip = ipaddress.ip_address(local)
    if ip.is_loopback or not (ip.is_private or ip.is_link_local):
        return None
    if listen_host not in WILDCARD_HOSTS and listen_host.strip("[]") != local:
        return None
    return f"[{local}]:{port}" if ip.version == 6 else f"{local}:{port}"
