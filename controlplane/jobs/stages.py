"""What agents report about the stages they host (the observed half of a Stage)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.jobs.models import Stage, StageState
from controlplane.nodes.models import Node

_STAGE_KEY = re.compile(r"^(?P<job>[0-9a-fA-F-]{36})-stage-(?P<index>\d+)(?:-rank-(?P<rank>[1-9]\d*))?$")
MAX_MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class StageReport:
    stage_id: str
    generation: int
    state: str  # StageState.READY or StageState.FAILED
    message: str = ""


def parse_stage_key(stage_id: str) -> tuple[uuid.UUID, int, int] | None:
    """`"<job uuid>-stage-<index>"` → (job id, index, 0), `"...-stage-<index>-rank-<rank>"` → (job id,
    index, rank) (models.stage_key); None for anything else."""
    match = _STAGE_KEY.match(stage_id)
    if match is None:
        return None
    try:
        return uuid.UUID(match["job"]), int(match["index"]), int(match["rank"] or 0)
    except ValueError:
        return None


def stages_record_observed(*, node: Node, reports: Sequence[StageReport]) -> bool:
    """Record the agent's reports on its active stages; returns whether any stage changed.

    A report counts only for the stage's current generation: a late report about a placement that has
    since changed must not make the new one look ready. Reports about stages this node does not host
    are ignored (the agent drops those stages once they are not in its assignments).
    """
    keys = {report.stage_id: parse_stage_key(report.stage_id) for report in reports}
    job_ids = {key[0] for key in keys.values() if key is not None}
    stages = {
        (stage.job_id, stage.index, stage.rank): stage
        for stage in Stage.objects.filter(node=node, active=True, job_id__in=job_ids)
    }
    changed = False
    for report in reports:
        key = keys[report.stage_id]
        stage = stages.get(key) if key is not None else None
        if stage is None or report.generation != stage.generation:
            continue
        observed = (report.generation, StageState(report.state), report.message[:MAX_MESSAGE_CHARS])
        if (stage.observed_generation, stage.observed_state, stage.observed_message) == observed:
            continue
        Stage.objects.filter(pk=stage.pk, generation=report.generation).update(
            observed_generation=observed[0], observed_state=observed[1], observed_message=observed[2]
        )
        changed = True
    return changed
