"""A node caught cheating rolls its job back: to the newest checkpoint its passed spot checks vouch for
(none: the seeded initial weights), newer checkpoints deleted, its stage moved to another node; the
checkpoint such a rollback needs survives pruning."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from django.utils import timezone

from arceus.contracts.counters import StageCounters
from arceus.contracts.spot_check import PARTIAL_GRADIENT, SpotCheckResult
from arceus.contracts.status import JobStatus
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.checkpoints import checkpoint_trusted
from controlplane.jobs.leases import job_driver_claim
from controlplane.jobs.models import Job, Stage
from controlplane.market.models import LedgerEntry, SpotCheck
from controlplane.market.services import ledger_record_work
from controlplane.market.verification import spot_checks_record
from controlplane.nodes.models import Node
from tests.controlplane.jobs import test_jobs_checkpoints as checkpoints
from tests.controlplane.jobs.test_jobs_checkpoints import DRIVER, save

# The checkpoint tests' fixtures: three Ready agents and a running job placed on them.
agents, checkpoint_dir, running_job = checkpoints.agents, checkpoints.checkpoint_dir, checkpoints.running_job

pytestmark = pytest.mark.django_db


def check(job: Job, stage: Stage, *, train_step: int, passed: bool) -> SpotCheckResult:
    return SpotCheckResult(
        step=train_step, micro_batch=0, stage_index=stage.index, node_id=str(stage.node_id), passed=passed,
        detail="matches" if passed else "output differs from the recomputation", train_step=train_step,
    )


def record(job: Job, *checks: SpotCheckResult) -> None:
    """The driver records its checks; the reconciler's pass that they nudged follows."""
    spot_checks_record(job_id=job.id, lease_owner=DRIVER, generation=job.generation, checks=list(checks),
                       now=timezone.now())
    reconcile_once()


def stage(job: Job, index: int) -> Stage:
    return Stage.objects.get(job=job, index=index, active=True)


def saved_steps(job: Job) -> list[int]:
    return sorted(job.checkpoints.values_list("step", flat=True))


def test_a_flag_rewinds_to_the_newest_checkpoint_before_the_last_passed_check(
    running_job: Job, ready_node, django_capture_on_commit_callbacks  # noqa: ANN001
) -> None:
    job, cheat = running_job, stage(running_job, 1)
    with django_capture_on_commit_callbacks(execute=True):
        for step in (10, 20):
            save(job, step)
        record(job, check(job, cheat, train_step=24, passed=True),
               check(job, stage(job, 0), train_step=29, passed=True))
        save(job, 30)
    ledger_record_work(job_id=job.id, generation=job.generation, node=cheat.node, flops_per_sample=1e3, step=33,
                       counters=StageCounters(1, 64, 8, 1.0, 100, 100), held_since=cheat.held_since,
                       now=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        record(job, check(job, cheat, train_step=33, passed=False))

    job.refresh_from_db()
    assert saved_steps(job) == [10, 20]  # 30 carries the cheat's activations of steps 25-30
    assert job.resume_checkpoint.step == 20 and job.step == 20
    assert job.status == JobStatus.PENDING and job.driver_lease_owner == ""
    training = next(c for c in job.conditions if c["type"] == "Training")
    assert training["reason"] == "NodeFlagged" and "resuming from the checkpoint of step 20" in training["message"]
    assert stage(job, 1).node_id is None and stage(job, 0).node_id is not None
    assert all(e.withheld for e in LedgerEntry.objects.filter(node=cheat.node))

    # The reconciler moves the stage to a spare node; the job still resumes from step 20.
    spare = ready_node("spare", port=50070)
    reconcile_once()
    job.refresh_from_db()
    assert stage(job, 1).node_id == spare.id and job.status == JobStatus.PLACING
    assert job.resume_checkpoint.step == 20
    assert not Node.objects.get(pk=spare.pk).flagged_at and Node.objects.get(pk=cheat.node_id).flagged_at


def test_a_node_never_vouched_for_rewinds_to_the_initial_weights(
    running_job: Job, django_capture_on_commit_callbacks  # noqa: ANN001
) -> None:
    job, cheat = running_job, stage(running_job, 0)
    with django_capture_on_commit_callbacks(execute=True):
        save(job, 10)
        record(job, check(job, cheat, train_step=12, passed=False))
    job.refresh_from_db()
    assert saved_steps(job) == [] and job.resume_checkpoint is None and job.step == 0
    assert stage(job, 0).node_id is None


def test_a_stale_driver_cannot_roll_the_job_back(running_job: Job) -> None:
    job = running_job
    save(job, 10)
    Job.objects.filter(pk=job.pk).update(generation=job.generation + 1)  # the job moved on meanwhile
    with pytest.raises(Exception, match="does not hold the driver lease"):
        record(job, check(job, stage(job, 0), train_step=12, passed=False))
    assert saved_steps(job) == [10]


def test_pruning_keeps_the_checkpoint_a_rollback_could_need(
    running_job: Job, checkpoint_dir: Path, django_capture_on_commit_callbacks  # noqa: ANN001
) -> None:
    job = running_job
    with django_capture_on_commit_callbacks(execute=True):
        for step in (10, 20):
            save(job, step)
        # Stage 1's node was last vouched for at step 25, the others at 55.
        record(job, check(job, stage(job, 1), train_step=25, passed=True),
               *(check(job, stage(job, i), train_step=55, passed=True) for i in (0, 2)))
        for step in (30, 40, 50):
            save(job, step)
    assert saved_steps(job) == [20, 40, 50]  # the newest two, and 20 for stage 1's node
    assert len(list(checkpoint_dir.rglob("*.safetensors"))) == 9


def test_a_passed_check_vouches_only_for_checkpoints_of_its_generation_or_before(running_job: Job) -> None:
    job, node = running_job, str(stage(running_job, 0).node_id)
    save(job, 10)
    record(job, check(job, stage(job, 0), train_step=25, passed=True))  # generation g
    Job.objects.filter(pk=job.pk).update(generation=job.generation + 1)  # a rewind: the run replays
    job.refresh_from_db()
    save(job, 20)  # saved by the replay, which no check of this node has vouched for yet
    assert checkpoint_trusted(job=job, node_ids=[node]).step == 10
    assert checkpoint_trusted(job=job, node_ids=[]).step == 20


def test_a_replicated_jobs_node_is_vouched_for_only_as_far_as_a_check_of_its_partial_gradient(
    running_job: Job,
) -> None:
    """A replica's partial gradient went into every replica's weights: a passed forward check at step 25 does not
    vouch for the checkpoint of step 20 unless a check of its partial gradient passed at 20 or later too."""
    job, node = running_job, str(stage(running_job, 0).node_id)
    Job.objects.filter(pk=job.pk).update(replicas_max=2)
    job.refresh_from_db()
    for step in (10, 20):
        save(job, step)
    partial = replace(check(job, stage(job, 0), train_step=12, passed=True), kind=PARTIAL_GRADIENT)
    record(job, check(job, stage(job, 0), train_step=25, passed=True), partial)
    assert checkpoint_trusted(job=job, node_ids=[node]).step == 10
    record(job, replace(partial, step=22, train_step=22))
    assert checkpoint_trusted(job=job, node_ids=[node]).step == 20
    # Of a job whose stages are not replicated, the forward check alone vouches for step 20.
    Job.objects.filter(pk=job.pk).update(replicas_max=1)
    job.refresh_from_db()
    SpotCheck.objects.filter(kind=PARTIAL_GRADIENT).delete()
    assert checkpoint_trusted(job=job, node_ids=[node]).step == 20


def test_a_caught_replica_leaves_its_stage_and_its_sibling_keeps_its_node(
    ready_node, queued_job, checkpoint_dir: Path, django_capture_on_commit_callbacks  # noqa: ANN001
) -> None:
    """A replicated job rolls back as any job does, but only the caught replica leaves: its sibling stays where it
    is (it is dropped, not unplaced: its stage keeps a replica to train with); once
    the job trains again, the reconciler adds a replica from a free node to make up the stage's minimum."""
    for i in range(4):
        ready_node(f"r{i}", port=50081 + i)
    job = queued_job(stages=2, replicas={"min": 2, "max": 2})
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status="running")
    assert job_driver_claim(job_id=job.id, owner=DRIVER, now=timezone.now()) is not None
    job.refresh_from_db()
    rows = {(s.index, s.replica): s for s in Stage.objects.filter(job=job, active=True)}
    assert sorted(rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    cheat, sibling = rows[(1, 1)], rows[(1, 0)]
    caught = replace(check(job, cheat, train_step=3, passed=False), replica=1, kind=PARTIAL_GRADIENT)
    with django_capture_on_commit_callbacks(execute=True):
        record(job, caught)
    job.refresh_from_db()
    left = {(s.index, s.replica): s.node_id for s in Stage.objects.filter(job=job, active=True)}
    assert sorted(left) == [(0, 0), (0, 1), (1, 0)] and left[(1, 0)] == sibling.node_id
    assert all(node is not None for node in left.values()) and job.step == 0
    training = next(c for c in job.conditions if c["type"] == "Training")
    assert training["reason"] == "NodeFlagged"
    assert job.status == JobStatus.PLACING  # every row placed: it rebuilds from the checkpoint and trains on
