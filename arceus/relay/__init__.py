"""Relays: a stateless process that pipes callers' connections to agents that cannot be dialled (docs/security.md)."""
