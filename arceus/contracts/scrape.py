"""An agent's scrape token: what Prometheus presents to one agent's /metrics, which opens nothing else.

HMAC-SHA256 of the node's id under the operator's metrics token (the control plane's ARCEUS_METRICS_TOKEN), so
nothing is stored and rotating the operator's token rotates every agent's. The agent is told only the token's
SHA-256 (in every heartbeat answer), and Prometheus the token itself, per target, by the agents' service
discovery (GET /metrics/agents, behind the operator's token): a contributor's agent never sees the operator's
token, and its own opens no other agent's metrics.
"""

from __future__ import annotations

import hashlib
import hmac

from arceus.contracts.credentials import token_digest

# The URL parameter Prometheus sends it in: service discovery cannot give a target a header of its own, but a
# `__param_<name>` label becomes a parameter of that target's scrape URL. (A bearer header works as well.)
SCRAPE_TOKEN_PARAMETER = "token"


def agent_scrape_token(metrics_token: str, node_id: str) -> str:
    """The token that opens node `node_id`'s agent's /metrics, under the operator's `metrics_token`."""
    if not metrics_token:
        raise ValueError("metrics are off (no ARCEUS_METRICS_TOKEN is set), so no agent has a scrape token")
    return hmac.new(metrics_token.encode(), f"agent-metrics/{node_id}".encode(), hashlib.sha256).hexdigest()


def agent_scrape_digest(metrics_token: str, node_id: str) -> str | None:
    """What node `node_id`'s agent checks a scrape's token against; None while metrics are off (no token: the
    agent refuses every scrape)."""
    return token_digest(agent_scrape_token(metrics_token, node_id)) if metrics_token else None
