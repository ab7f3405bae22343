"""What agents report about the stages they host (the observed half of a Stage)."""

from __future__ import annotations

from collections.abc import Sequence

from arceus.contracts.observed import ObservedStage, ObservedState
from arceus.contracts.stage_key import parse_stage_key
from controlplane.jobs.models import Stage
from controlplane.nodes.models import Node

MAX_MESSAGE_CHARS = 2000


def stages_record_observed(*, node: Node, reports: Sequence[ObservedStage]) -> bool:
    """Record the agent's reports on its active stages; returns whether any stage changed.

    A report counts only for the stage's current generation: a late report about a placement that has
    since changed must not make the new one look ready. Reports about stages this node does not host
    are ignored (the agent drops those stages once they are not in its assignments).
    """
    keys = {report.stage_id: parse_stage_key(report.stage_id) for report in reports}
    job_ids = {key[0] for key in keys.values() if key is not None}
    stages = {
        (stage.job_id, stage.index, stage.rank, stage.replica): stage
        for stage in Stage.objects.filter(node=node, active=True, job_id__in=job_ids)
    }
    changed = False
    for report in reports:
        key = keys[report.stage_id]
        stage = stages.get((key.job_id, key.index, key.rank, key.replica or 0)) if key is not None else None
        if stage is None or report.generation != stage.generation:
            continue
        observed = (report.generation, ObservedState(report.state), report.message[:MAX_MESSAGE_CHARS])
        if (stage.observed_generation, stage.observed_state, stage.observed_message) == observed:
            continue
        Stage.objects.filter(pk=stage.pk, generation=report.generation).update(
            observed_generation=observed[0], observed_state=observed[1], observed_message=observed[2]
        )
        changed = True
    return changed
