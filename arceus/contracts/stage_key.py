"""A stage's id as its agents know it: `"<job>-stage-<index>"`, or `"<job>-stage-<index>-rank-<rank>"` for
rank 1, 2, ... of a tensor-parallel stage (rank 0's id is the stage's). Deterministic, so a rerun of the
reconciler finds a placement instead of duplicating it."""

from __future__ import annotations

import re
import uuid

_STAGE_KEY = re.compile(r"^(?P<job>[0-9a-fA-F-]{36})-stage-(?P<index>\d+)(?:-rank-(?P<rank>[1-9]\d*))?$")


def stage_key(job_id: object, index: int, rank: int = 0) -> str:
    return f"{job_id}-stage-{index}" + (f"-rank-{rank}" if rank else "")


def parse_stage_key(stage_id: str) -> tuple[uuid.UUID, int, int] | None:
    """(job id, index, rank) of a `stage_key`; None for anything else."""
    match = _STAGE_KEY.match(stage_id)
    if match is None:
        return None
    try:
        return uuid.UUID(match["job"]), int(match["index"]), int(match["rank"] or 0)
    except ValueError:
        return None
