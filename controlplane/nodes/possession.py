"""Registration challenges (arceus/contracts/possession.py has the proof): a challenge is bound to one node and
expires; it is stateless, an HMAC under a key derived from SECRET_KEY, so any web process checks what another issued.
A challenge reused within its lifetime proves only what it proved before, for the same node."""

from __future__ import annotations

import hmac
import secrets
from datetime import datetime

from django.utils.crypto import salted_hmac

from arceus.contracts.possession import possession_check
from controlplane.common.errors import ApplicationError
from controlplane.nodes.models import Node

CHALLENGE_SECONDS = 300
_SALT = "arceus.registration-challenge"


def registration_challenge_new(*, node: Node, now: datetime) -> str:
    """A challenge for `node`'s next registration, valid for CHALLENGE_SECONDS."""
    body = f"{int(now.timestamp()) + CHALLENGE_SECONDS}.{secrets.token_urlsafe(16)}"
    return f"{body}.{_mac(node, body)}"


def registration_possession_check(
    *, node: Node, challenge: str, certificate: str, proof: str, now: datetime
) -> None:
    """Nothing if `proof` signs a live challenge issued to `node` with `certificate`'s key; a 400 naming the field
    otherwise."""
    body, _, mac = challenge.rpartition(".")
    expires, _, _ = body.partition(".")
    if not body or not hmac.compare_digest(mac, _mac(node, body)) or not expires.isdigit():
        raise ApplicationError.invalid(
            "challenge", "not a challenge issued to this node; POST /api/agent/challenge for one"
        )
    if int(expires) < now.timestamp():
        raise ApplicationError.invalid(
            "challenge", f"expired (a challenge lasts {CHALLENGE_SECONDS} s); POST /api/agent/challenge for a new one"
        )
    try:
        possession_check(certificate, challenge, proof)
    except ValueError as exc:
        raise ApplicationError.invalid("tls_proof", str(exc)) from None


def _mac(node: Node, body: str) -> str:
    return salted_hmac(_SALT, f"{node.pk}.{body}", algorithm="sha256").hexdigest()
