"""A stage's id as its agents know it: `"<job>-stage-<index>"`, `"<job>-stage-<index>-rank-<rank>"` for rank 1,
2, ... of a tensor-parallel stage (rank 0's id is the stage's), or `"<job>-stage-<index>-replica-<replica>"` for
a replica of a replicated stage (arceus/swarm). Deterministic, so a rerun of the reconciler finds a placement
instead of duplicating it."""

from __future__ import annotations

import re
import uuid
from typing import NamedTuple

_STAGE_KEY = re.compile(
    r"^(?P<job>[0-9a-fA-F-]{36})-stage-(?P<index>\d+)"
    r"(?:-rank-(?P<rank>[1-9]\d*)|-replica-(?P<replica>0|[1-9]\d*))?$"
)


class StageKey(NamedTuple):
    job_id: uuid.UUID
    index: int
    rank: int
    replica: int | None  # None: the stage is not replicated


def stage_key(job_id: object, index: int, rank: int = 0, replica: int | None = None) -> str:
    """`replica`: the replica id where the stage is replicated (never tensor-parallel then)."""
    if replica is not None:
        return f"{job_id}-stage-{index}-replica-{replica}"
    return f"{job_id}-stage-{index}" + (f"-rank-{rank}" if rank else "")


def parse_stage_key(stage_id: str) -> StageKey | None:
    """The parts of a `stage_key`; None for anything else."""
    match = _STAGE_KEY.match(stage_id)
    if match is None:
        return None
    try:
        job_id = uuid.UUID(match["job"])
    except ValueError:
        return None
    replica = match["replica"]
    return StageKey(job_id, int(match["index"]), int(match["rank"] or 0), None if replica is None else int(replica))
