"""Agents' and relays' TLS certificates as the contracts carry them (PEM, one per address a stage calls) and their
check; the identities themselves are made in `arceus.wire.tls`."""

from __future__ import annotations

from cryptography import x509

# The name in every agent certificate, and the name callers check: the pinned certificate, not the name, is what
# identifies an agent, and an agent's address (an IP behind a router, a relay) says nothing about it.
AGENT_TLS_NAME = "arceus-agent"
RELAY_TLS_NAME = "arceus-relay"  # the same, for relays
MAX_CERTIFICATE_CHARS = 4096


def check_certificate(pem: str, tls_name: str = AGENT_TLS_NAME) -> str:
    """`pem` if it is one PEM certificate for `tls_name`; ValueError saying why not."""
    if not isinstance(pem, str) or not pem or len(pem) > MAX_CERTIFICATE_CHARS:
        raise ValueError(f"must be a PEM certificate of at most {MAX_CERTIFICATE_CHARS} characters")
    try:
        certificate = x509.load_pem_x509_certificate(pem.encode())
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise ValueError(f"is not a PEM certificate with a subject alternative name: {exc}") from None
    if tls_name not in names.get_values_for_type(x509.DNSName):
        raise ValueError(f"must name {tls_name!r} (new_identity makes it so)")
    return pem
