"""The client's address as the control plane sees it: REMOTE_ADDR, or behind ARCEUS_TRUSTED_PROXIES proxies (each
appending to X-Forwarded-For, as deploy/nginx.conf does) the entry the outermost trusted one appended. Entries left
of it are the client's own claims and are never believed."""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest


def client_ip(request: HttpRequest) -> str | None:
    """The client's IP address; None when the request did not pass the trusted proxies or the address is not an
    IP (then nothing is decided on it)."""
    hops = settings.ARCEUS_TRUSTED_PROXIES
    if hops == 0:
        candidate = request.META.get("REMOTE_ADDR", "")
    else:
        forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
        if len(forwarded) < hops:
            return None
        candidate = forwarded[-hops]
    try:
        return str(ipaddress.ip_address(candidate))
    except ValueError:
        return None
