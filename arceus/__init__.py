"""Arceus: train models on other people's idle computers. `from arceus import DistributedTrainer` is the SDK
(arceus.trainer); it is imported on first use, so the agent and the control plane, which import `arceus.*`
modules, never load it."""

from __future__ import annotations

from typing import Any

__all__ = ["DistributedTrainer"]


def __getattr__(name: str) -> Any:
    if name == "DistributedTrainer":
        from arceus.trainer import DistributedTrainer

        return DistributedTrainer
    raise AttributeError(f"module 'arceus' has no attribute {name!r}")
