"""What the training driver records: steps, epochs, the stages' work counters (as contributions and
priced ledger entries), and the end.

Every write is guarded by the driver lease (`controlplane.jobs.leases`), so a driver that lost its
lease, or whose job was cancelled, learns it from a False return and stops; each write renews the lease.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F, Q

from arceus.contracts.counters import StageCounters
from arceus.contracts.status import JobStatus
from arceus.errors import SpecError
from arceus.model.registry import model_spec_from_config
from arceus.training.plan import ReplicaJoin, StageTiming
from controlplane.common.dispatch import reconcile_soon
from controlplane.jobs.leases import held, renewed
from controlplane.jobs.models import EpochMetric, Job, LossPoint, Stage, StageContribution
from controlplane.market.services import job_budget_micros, ledger_record_work
from controlplane.nodes.models import Node

# The work a stage's agent counts, as stage rows, contributions and ledger entries store it.
COUNTER_FIELDS = ("samples", "micro_batches", "compute_seconds", "bytes_sent", "bytes_received")


@dataclass(frozen=True)
class StepPoint:
    epoch: int
    step: int
    total_steps: int
    loss: float
    samples_per_second: float


@transaction.atomic
def job_record_steps(
    *,
    job_id: Any,
    lease_owner: str,
    points: Sequence[StepPoint],
    now: datetime,
    stages: Sequence[StageCounters] = (),
    timings: Sequence[StageTiming] = (),
) -> bool:
    """Record a batch of training steps (the newest becomes the job's progress), the stages' latest
    counters and their time per step (computing and waiting), and renew the lease; with no points it only
    renews. False if the caller no longer holds the lease."""
    fields: dict[str, Any] = renewed(now)
    if points:
        last = points[-1]
        fields.update(
            step=last.step,
            total_steps=last.total_steps,
            epoch=last.epoch,
            last_loss=_finite(last.loss),
            samples_per_second=_finite(last.samples_per_second),
        )
    if not held(job_id, lease_owner).update(**fields):
        return False
    # Upsert: a restarted driver replays steps it recorded before.
    LossPoint.objects.bulk_create(
        [
            LossPoint(
                job_id=job_id,
                step=p.step,
                epoch=p.epoch,
                loss=_finite(p.loss),
                samples_per_second=_finite(p.samples_per_second),
            )
            for p in points
        ],
        update_conflicts=True,
        unique_fields=["job", "step"],
        update_fields=["epoch", "loss", "samples_per_second"],
    )
    _record_counters(job_id, stages, now)
    for t in timings:
        # a replica's timing is its own row's (by its node); a stage's, its rank 0's
        row = {"node_id": t.node_id} if t.node_id else {"rank": 0}
        Stage.objects.filter(job_id=job_id, active=True, index=t.index, **row).update(
            step_compute_seconds=_finite(t.compute_seconds), step_wait_seconds=_finite(t.wait_seconds),
            step_micro_batches=_finite(t.micro_batches) if t.micro_batches > 0 else None,
            step_samples_per_second=(
                _finite(t.samples / t.compute_seconds) if t.samples > 0 and t.compute_seconds > 0 else None
            ),
        )
    _measure_nodes(job_id, timings, now)
    return True


def _measure_nodes(job_id: Any, timings: Sequence[StageTiming], now: datetime) -> None:
    """Each hosting node's speed as the driver measured it (what the market prices and places it by): the FLOPs of
    the samples it ran in the step (a replica's own share, as the driver routed them; an unreplicated stage's, the
    batch) over the step's wall time on the driver's clock, the longest of the stages' calls. No node can shorten
    that time: a step ends only when every stage's forward and backward are done, so the figure is at most the
    node's real speed (its share of the pipeline's bubble counts against it), whatever the node reports."""
    wall = max((t.wall_seconds for t in timings if math.isfinite(t.wall_seconds)), default=0.0)
    if wall <= 0:
        return
    rows = list(Stage.objects.filter(job_id=job_id, active=True, node__isnull=False).select_related("job"))
    ranks = _group_ranks(rows)
    for t in timings:
        # a replica's timing is its own node's; a stage's (node_id ""), every rank's of its tensor-parallel group
        for stage in (s for s in rows if s.index == t.index and t.node_id in ("", str(s.node_id))):
            samples = t.samples if t.samples > 0 else _batch_size(stage)
            per_step = 3.0 * samples * _stage_flops_per_sample(stage, ranks[(stage.index, stage.replica)])
            if per_step > 0:
                Node.objects.filter(pk=stage.node_id).update(flops_measured=per_step / wall, flops_measured_at=now)


def _group_ranks(rows: Sequence[Stage]) -> Counter[tuple[int, int]]:
    """The ranks of each (stage, replica): a tensor-parallel group's size; a replica holds its whole stage."""
    return Counter((s.index, s.replica) for s in rows)


def _batch_size(stage: Stage) -> int:
    return int((stage.job.dataset_config or {}).get("batch_size") or 0)


def stage_timings_mean(steps: Sequence[Sequence[StageTiming]]) -> list[StageTiming]:
    """Each stage's (each replica's) mean time, samples and micro-batches per step over `steps` (each step's
    timings, one per stage or replica); a replica is averaged over the steps it took part in."""
    by_key: dict[tuple[int, str], list[StageTiming]] = {}
    for step in steps:
        for t in step:
            by_key.setdefault((t.index, t.node_id), []).append(t)
    return [
        StageTiming(
            index,
            sum(t.compute_seconds for t in ts) / len(ts),
            sum(t.wait_seconds for t in ts) / len(ts),
            sum(t.wall_seconds for t in ts) / len(ts),
            node_id=node_id,
            samples=sum(t.samples for t in ts) / len(ts),
            micro_batches=sum(t.micro_batches for t in ts) / len(ts),
        )
        for (index, node_id), ts in sorted(by_key.items())
    ]


@transaction.atomic
def job_record_epoch(
    *,
    job_id: Any,
    lease_owner: str,
    epoch: int,
    val_loss: float,
    val_accuracy: float,
    stages: Sequence[StageCounters],
    now: datetime,
) -> bool:
    """Record an epoch's validation and the stages' cumulative counters; False without the lease."""
    recorded = held(job_id, lease_owner).update(
        val_loss=_finite(val_loss),
        val_accuracy=_finite(val_accuracy),
        **renewed(now),
    )
    if not recorded:
        return False
    EpochMetric.objects.update_or_create(
        job_id=job_id,
        epoch=epoch,
        defaults={"val_loss": _finite(val_loss), "val_accuracy": _finite(val_accuracy)},
    )
    _record_counters(job_id, stages, now)
    return True


def stage_record_joined(*, job_id: Any, lease_owner: str, generation: int, join: ReplicaJoin) -> bool:
    """Record, on its placement row, that a joining replica copied its stage's state from a live replica (the
    driver's word: bytes and digests); False without the lease."""
    if not held(job_id, lease_owner).filter(generation=generation).exists():
        return False
    Stage.objects.filter(
        job_id=job_id, index=join.index, replica=join.replica, generation=generation, active=True
    ).update(joined={"from_replica": join.source_replica, "size_bytes": join.size_bytes, "sha256": join.sha256,
                     "state_sha256": join.state_sha256})
    return True


@transaction.atomic
def job_finish(
    *,
    job_id: Any,
    lease_owner: str,
    final_loss: float,
    val_loss: float,
    val_accuracy: float,
    stages: Sequence[StageCounters],
    now: datetime,
) -> bool:
    """Record the end of training (final metrics and counters) and that the driver trained the job to the end,
    from which the reconciler marks it succeeded and releases its nodes; False if the caller no longer holds the
    lease."""
    job = held(job_id, lease_owner).select_for_update().first()
    if job is None:
        return False
    accuracy = _finite(val_accuracy)
    summary = f"trained {job.step} steps" + (f", val accuracy {accuracy:.4f}" if accuracy is not None else "")
    job.final_loss, job.val_loss, job.val_accuracy = _finite(final_loss), _finite(val_loss), accuracy
    job.save(update_fields=["final_loss", "val_loss", "val_accuracy"])
    _record_counters(job_id, stages, now)
    _record_outcome(job, JobStatus.SUCCEEDED, "Completed", summary)
    return True


@transaction.atomic
def job_record_failure(*, job_id: Any, lease_owner: str, reason: str, message: str) -> bool:
    """Record that the driver cannot train the job (an invalid spec, a crash of its own), from which the
    reconciler fails it; False if the caller no longer holds the lease."""
    job = held(job_id, lease_owner).select_for_update().first()
    if job is None:
        return False
    _record_outcome(job, JobStatus.FAILED, reason, message)
    return True


def _record_outcome(job: Job, status: JobStatus, reason: str, message: str) -> None:
    """The driver's last word on the locked job, at its generation: a fact for the reconciler's rules."""
    job.driver_outcome, job.driver_outcome_reason, job.driver_outcome_message = status, reason, message
    job.driver_outcome_generation = job.generation
    job.save(update_fields=[
        "driver_outcome", "driver_outcome_reason", "driver_outcome_message", "driver_outcome_generation"
    ])
    reconcile_soon()


def contributions_release(*, rows: Sequence[Stage], now: datetime) -> None:
    """Replicas' rows about to be deleted while their job runs (`DropReplicas`): each node's contribution for the
    generation keeps what billing them needs (the counters written so far, when the node began to hold the replica and
    that it held it until `now`), so counters the driver measured before the loss and writes after it are billed."""
    StageContribution.objects.bulk_create(
        [
            StageContribution(
                job_id=s.job_id, stage_index=s.index, generation=s.generation, node_id=s.node_id,
                held_since=s.held_since, released_at=now, **{name: getattr(s, name) for name in COUNTER_FIELDS},
            )
            for s in rows
            if s.node_id is not None
        ],
        update_conflicts=True,
        unique_fields=["job", "stage_index", "generation", "node"],
        update_fields=["held_since", "released_at", "updated_at"],
    )


def _record_counters(job_id: Any, stages: Sequence[StageCounters], now: datetime) -> None:
    """Store the stages' counters (cumulative within the current generation) on the stage rows, on each
    node's contribution row for this generation, and as priced ledger entries (the devices' time held until `now`);
    called only by the lease holder, so the stage rows are the ones the counters came from. A replica dropped since
    (`contributions_release`) is billed on its contribution for the time it held its node until it was dropped."""
    if not stages:
        return
    rows = list(Stage.objects.filter(job_id=job_id, active=True).select_related("node", "job"))
    placed = {(s.index, str(s.node_id)): s for s in rows} | {(s.index, ""): s for s in rows if s.rank == 0}
    ranks = _group_ranks(rows)
    released = _released(job_id, [s for s in stages if s.node_id and (s.index, s.node_id) not in placed], rows)
    contributions = []
    for s in stages:
        counters = {name: getattr(s, name) for name in COUNTER_FIELDS}
        stage = placed.get((s.index, s.node_id))
        if stage is None and (s.index, s.node_id) in released:
            contribution, sibling = released[(s.index, s.node_id)]
            StageContribution.objects.filter(pk=contribution.pk).update(**counters, updated_at=now)
            ledger_record_work(
                job_id=job_id, generation=contribution.generation, node=contribution.node, counters=s,
                flops_per_sample=_stage_flops_per_sample(sibling, ranks[(sibling.index, sibling.replica)]),
                step=sibling.job.step,
                held_since=contribution.held_since, now=min(now, contribution.released_at),
                budget_micros=job_budget_micros(sibling.job.requirements),
            )
            continue
        if stage is None or stage.node is None:
            continue
        Stage.objects.filter(pk=stage.pk).update(**counters)
        contributions.append(
            StageContribution(
                job_id=job_id, stage_index=s.index, generation=stage.generation, node_id=stage.node_id, **counters
            )
        )
        ledger_record_work(
            job_id=job_id,
            generation=stage.generation,
            node=stage.node,
            counters=s,
            flops_per_sample=_stage_flops_per_sample(stage, ranks[(stage.index, stage.replica)]),
            step=stage.job.step,  # already the newest recorded step: a rewind refunds what lies past its checkpoint
            held_since=stage.held_since,
            now=now,
            budget_micros=job_budget_micros(stage.job.requirements),
        )
    StageContribution.objects.bulk_create(
        contributions,
        update_conflicts=True,
        unique_fields=["job", "stage_index", "generation", "node"],
        update_fields=[*COUNTER_FIELDS, "updated_at"],
    )


def _released(
    job_id: Any, stages: Sequence[StageCounters], rows: Sequence[Stage]
) -> dict[tuple[int, str], tuple[StageContribution, Stage]]:
    """Of `stages` (counters without a placed row), those of replicas dropped at the job's generation: each with its
    contribution and a live sibling row (its stage's layers and job; a stage without one has rewound)."""
    if not stages:
        return {}
    siblings = {s.index: s for s in rows}
    wanted = Q()
    for s in stages:
        wanted |= Q(stage_index=s.index, node_id=s.node_id)
    found = StageContribution.objects.filter(
        wanted, job_id=job_id, generation=F("job__generation"), released_at__isnull=False
    ).select_related("node")
    return {(c.stage_index, str(c.node_id)): (c, siblings[c.stage_index]) for c in found if c.stage_index in siblings}


def _stage_flops_per_sample(stage: Stage, ranks: int) -> float:
    """The forward FLOPs per sample the stage's node does: a tensor-parallel rank does its share of
    each transformer block (embedding and head are whole on every rank)."""
    try:
        spec = model_spec_from_config(stage.job.model_config)
    except SpecError:
        return 0.0  # validated at submit; a model the library no longer accepts is not billed by FLOPs
    costs = spec.layer_flops_per_sample()
    split = spec.split_layers()
    return float(sum(costs[i] / (ranks if i in split else 1) for i in range(stage.layer_start, stage.layer_end)))


def _finite(value: float | None) -> float | None:
    """NaN and infinities are not JSON; the API shows them as null."""
    return float(value) if value is not None and math.isfinite(value) else None
