"""A replicated job's `replica_sync`: how often the replicas of a stage (arceus/swarm) agree.

    {"every_steps": 1}                                           exact (the default): gradients summed every step
    {"every_steps": 16, "outer_lr": 0.7, "outer_momentum": 0.9}  DiLoCo: local steps, averaged every 16

Every step, the replicas sum their gradients before the same optimizer step: training equals one process on the
same global batch. Every H > 1 steps, each replica takes its own optimizer steps on its share of each step's
micro-batches; at steps H, 2H, ... the replicas average their weight deltas since the last sync and apply them
through an outer Nesterov SGD (DiLoCo, arXiv:2311.08105), and average their optimizer state, so they leave
every sync with the same bits; this does not equal one process. Torch-free: the control plane checks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from arceus.errors import SpecError

MAX_EVERY_STEPS = 100_000
_FIELDS = ("every_steps", "outer_lr", "outer_momentum")


@dataclass(frozen=True)
class ReplicaSync:
    every_steps: int = 1
    outer_lr: float = 0.7  # DiLoCo's outer learning rate
    outer_momentum: float = 0.9  # its Nesterov momentum

    @property
    def exact(self) -> bool:
        """Gradients summed every step: the replicas equal one process."""
        return self.every_steps == 1

    def syncs_at(self, step: int) -> bool:
        """Whether the replicas average after the optimizer step of (1-based, job-wide) `step`."""
        return step % self.every_steps == 0

    def to_json(self) -> dict[str, Any]:
        if self.exact:
            return {"every_steps": 1}
        return {name: getattr(self, name) for name in _FIELDS}


def replica_sync_from_json(value: Any, *, field: str = "replica_sync") -> ReplicaSync:
    """Parse and validate (None: the default, exact); SpecError naming the field, like "replica_sync.outer_lr"."""
    if value is None:
        return ReplicaSync()
    if not isinstance(value, dict):
        raise SpecError(field, f"must be an object such as {{\"every_steps\": 16}}, got {type(value).__name__}")
    if unknown := sorted(set(value) - set(_FIELDS)):
        raise SpecError(f"{field}.{unknown[0]}", f"unknown field; known: {', '.join(_FIELDS)}")
    every = value.get("every_steps", 1)
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_EVERY_STEPS:
        raise SpecError(
            f"{field}.every_steps",
            f"must be an integer in [1, {MAX_EVERY_STEPS}] (1: exact, every step), got {every!r}",
        )
    defaults = ReplicaSync()
    if every == 1:
        if outer := [name for name in ("outer_lr", "outer_momentum") if name in value]:
            raise SpecError(
                f"{field}.{outer[0]}", "applies only when replicas sync every few steps (every_steps > 1)"
            )
        return defaults
    lr = value.get("outer_lr", defaults.outer_lr)
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or not 0 < lr <= 10:
        raise SpecError(f"{field}.outer_lr", f"must be a number in (0, 10], got {lr!r}")
    momentum = value.get("outer_momentum", defaults.outer_momentum)
    if (
        isinstance(momentum, bool) or not isinstance(momentum, int | float) or not math.isfinite(momentum)
        or not 0 <= momentum < 1
    ):
        raise SpecError(f"{field}.outer_momentum", f"must be a number in [0, 1), got {momentum!r}")
    return ReplicaSync(every, float(lr), float(momentum))
