"""What an agent reports about a stage it was assigned (the observed half of a placement), in every
heartbeat: built (`ready`) or not (`failed`, with the reason)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ObservedState(StrEnum):
    PENDING = "pending"  # nothing reported yet for the stage's current generation
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class ObservedStage:
    stage_id: str  # arceus.contracts.stage_key
    generation: int
    state: str  # ObservedState.READY or FAILED
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"stage_id": self.stage_id, "generation": self.generation, "state": self.state,
                "message": self.message}
