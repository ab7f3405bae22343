"""Rolling a job back to before the work of a node caught cheating.

A perturbed activation flows into every later stage's gradients, so draining the node from the
current state would keep its effect in the model. Instead the job rewinds to the newest checkpoint
that the node's passed spot checks vouch for (`checkpoint_trusted`) and the checkpoints after it,
whose weights carry the cheat, are deleted.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from django.db import transaction

from arceus.contracts.status import ACTIVE_STATUSES
from controlplane.controller.transitions import job_rewind
from controlplane.jobs.checkpoints import checkpoint_trusted, checkpoints_delete
from controlplane.jobs.models import Job, Stage


@transaction.atomic
def job_roll_back(*, job_id: Any, generation: int, node_ids: Collection[str], message: str, now: datetime) -> bool:
    """Rewind the job to the newest checkpoint every one of `node_ids` passed a spot check at or after
    (none: the initial weights, uploaded or seeded), delete the newer checkpoints, and unplace the nodes'
    stages so the reconciler moves them to other nodes (a caught replica whose stage keeps another is dropped
    instead; each unplaced row is named by its replica, so no sibling is unplaced with it). The nodes are not paid
    for the rolled-back steps, and the job's owner is charged for them once (`job_rewind`). False if the job moved on
    since `generation`."""
    job = Job.objects.select_for_update().filter(pk=job_id, generation=generation, status__in=ACTIVE_STATUSES).first()
    if job is None:
        return False
    trusted = checkpoint_trusted(job=job, node_ids=node_ids)
    polluted = job.checkpoints.all() if trusted is None else job.checkpoints.filter(step__gt=trusted.step)
    checkpoints_delete(polluted)  # before the rewind, which resumes from the newest checkpoint left
    caught = list(job.stages.filter(active=True, node_id__in=list(node_ids)))
    # A caught replica of a stage that keeps another leaves the job (as a lost one does; the reconciler adds
    # replicas back up to min from free nodes); a stage's only replica, or a stage that is not replicated, moves.
    kept = {s.index for s in job.stages.filter(active=True, node__isnull=False).exclude(node_id__in=list(node_ids))}
    dropped = [s.pk for s in caught if job.replicated and s.index in kept]
    Stage.objects.filter(pk__in=dropped).delete()
    moves = {(s.index, s.rank, s.replica): None for s in caught if s.pk not in dropped}
    return job_rewind(
        job_id=job.pk, generation=generation, moves=moves, culprits=node_ids, reason="NodeFlagged", message=message,
        now=now,
    )
