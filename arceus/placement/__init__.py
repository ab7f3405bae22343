"""Placement: how a model's layers are split into pipeline stages over nodes (pure, Django-free)."""
