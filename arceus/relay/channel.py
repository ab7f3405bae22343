"""Channels to a relay, for an agent attaching to it and for callers dialling through it: TLS that trusts exactly
the relay certificate the control plane hands out (the operator's, `ARCEUS_RELAY_CERTIFICATE_FILE`), never a
plaintext port. A relay that cannot show that certificate is refused, so nobody on the path can pose as one and
collect attachment tickets; the agent's own TLS and token still run end to end inside."""

from __future__ import annotations

from typing import Any

import grpc

from arceus.contracts.certificates import RELAY_TLS_NAME


def relay_channel(address: str, certificate: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to the relay at `address` that trusts only `certificate` (PEM). Never through an HTTP proxy: the
    process's own proxy for relayed agents (arceus.relay.dialer) leads here."""
    if not certificate:
        raise ValueError(f"no TLS certificate is pinned for the relay at {address}: the control plane hands it out "
                         "with the relays (ARCEUS_RELAY_CERTIFICATE_FILE)")
    return grpc.secure_channel(
        address, grpc.ssl_channel_credentials(root_certificates=certificate.encode()),
        options=[*(options or []), ("grpc.ssl_target_name_override", RELAY_TLS_NAME), ("grpc.enable_http_proxy", 0)],
    )
