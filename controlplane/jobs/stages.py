"""What agents report about the stages they host (the observed half of a Stage), and the one rule both heartbeat
paths judge a report by (`observed_update`): the API records what it changes (`stages_record_observed`); the quiet
heartbeat records what changes on the stages the node's assignments name (`observed_changes`,
`stages_record_changes`), and hands Django any report about another stage."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Protocol

from django.db import transaction

from arceus.contracts.observed import ObservedStage, ObservedState
from arceus.contracts.stage_key import parse_stage_key
from controlplane.common.dispatch import reconcile_soon
from controlplane.jobs.models import Stage
from controlplane.nodes.models import Node

MAX_MESSAGE_CHARS = 2000

StageRowKey = tuple[uuid.UUID, int, int, int]  # (job, index, rank, replica) of a Stage row
Observed = tuple[int, ObservedState, str]  # (generation, state, message) as a Stage row keeps them


class ObservedRow(Protocol):
    """A stage's placement generation and what was last recorded of it: a Stage, or the quiet heartbeat's read."""

    @property
    def generation(self) -> int: ...
    @property
    def observed_generation(self) -> int | None: ...
    @property
    def observed_state(self) -> str: ...
    @property
    def observed_message(self) -> str: ...


def stage_row_key(stage_id: str) -> StageRowKey | None:
    """The row a report's `stage_id` names; None when it names none (a report the API ignores)."""
    key = parse_stage_key(stage_id)
    return None if key is None else (key.job_id, key.index, key.rank, key.replica or 0)


def observed_update(report: ObservedStage, stage: ObservedRow | None) -> Observed | None:
    """What `report` changes on `stage` (the row it names, None: not one this node hosts), or None when nothing:
    a report counts only for the stage's current generation (a late report about a placement that has since
    changed must not make the new one look ready), and one equal to what is recorded changes nothing."""
    if stage is None or report.generation != stage.generation:
        return None
    observed = (report.generation, ObservedState(report.state), report.message[:MAX_MESSAGE_CHARS])
    if (stage.observed_generation, stage.observed_state, stage.observed_message) == observed:
        return None
    return observed


def observed_changes(
    reports: Sequence[ObservedStage], hosted: Mapping[StageRowKey, ObservedRow]
) -> list[tuple[StageRowKey, int, Observed]] | None:
    """What `stages_record_observed` would record of `reports`, judged from `hosted` alone (the rows of the stages the
    node's assignments name): each changed row's key, the generation it is recorded at, and what it records. None
    when a report names a stage outside them (of a job no longer hosted, or withheld): it may still name an active
    row of the node's, which only the API reads."""
    changes = []
    for report in reports:
        key = stage_row_key(report.stage_id)
        if key is None:  # names no stage: the API ignores it as well
            continue
        if key not in hosted:
            return None
        observed = observed_update(report, hosted[key])
        if observed is not None:
            changes.append((key, report.generation, observed))
    return changes


def stages_record_changes(changes: Sequence[tuple[object, StageRowKey, int, Observed]]) -> int:
    """Record `observed_changes` of many nodes (each change with its node's id), as `stages_record_observed` would:
    on the node's active row of that stage, still at the generation reported. How many rows changed; the reconciler
    is nudged when any did."""
    changed = 0
    with transaction.atomic():
        # In the rows' key order, whatever order the heartbeats came in: two batches lock rows they share alike.
        for node_id, (job_id, index, rank, replica), generation, observed in sorted(
            changes, key=lambda change: (str(change[1][0]), *change[1][1:])
        ):
            changed += Stage.objects.filter(
                node_id=node_id, job_id=job_id, index=index, rank=rank, replica=replica, active=True,
                generation=generation,
            ).update(observed_generation=observed[0], observed_state=observed[1], observed_message=observed[2])
        if changed:
            reconcile_soon()
    return changed


def stages_record_observed(*, node: Node, reports: Sequence[ObservedStage]) -> bool:
    """Record the agent's reports on its active stages (`observed_update`); returns whether any stage changed.
    Reports about stages this node does not host are ignored (the agent drops those stages once they are not in
    its assignments)."""
    keys = {report.stage_id: stage_row_key(report.stage_id) for report in reports}
    job_ids = {key[0] for key in keys.values() if key is not None}
    stages = {
        (stage.job_id, stage.index, stage.rank, stage.replica): stage
        for stage in Stage.objects.filter(node=node, active=True, job_id__in=job_ids)
    }
    changed = False
    for report in reports:
        key = keys[report.stage_id]
        stage = stages.get(key) if key is not None else None
        observed = observed_update(report, stage)
        if stage is None or observed is None:
            continue
        Stage.objects.filter(pk=stage.pk, generation=report.generation).update(
            observed_generation=observed[0], observed_state=observed[1], observed_message=observed[2]
        )
        changed = True
    return changed
