"""The training-driver task against real in-process node agents, and its idempotence.

The task function is called directly (no worker): placement, readiness and start go through the same
services and reconciler a deployment runs. Transactions really commit: the driver renews its lease
from a thread of its own, on its own database connection, which must see the job.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.controller.executor import reconcile_once
from controlplane.driver.driving import train_plan
from controlplane.jobs.models import EpochMetric, Job, LossPoint, Stage
from controlplane.jobs.services import job_start, job_submit
from tasks.control import reconcile
from tasks.training import run_job

pytestmark = pytest.mark.django_db(transaction=True)

JOB = {
    "model_config": {"layer_sizes": [64, 32, 16, 10]},
    "dataset_config": {"name": "digits", "batch_size": 64, "val_batch_size": 360},
    "epochs": 2,
    "learning_rate": 0.1,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 2,
    "seed": 1,
    "stages": 3,
    "requirements": {"owner_diversity": False},  # the live nodes are all the user's
}


def started_job(user, live_nodes, **overrides: object) -> Job:
    """Submit, place, let the agents build their stages, and start: the job is running, its driver
    task enqueued (and never consumed: no worker runs here)."""
    for live in live_nodes:
        live.sync()
    job = job_start(job=job_submit(owner=user, **{**JOB, **overrides}))
    reconcile()  # the task itself: place
    for live in live_nodes:
        live.sync()  # build the stage
        live.sync()  # report it ready
    reconcile_once()
    job.refresh_from_db()
    assert job.status == "running", job.conditions
    return job


def test_the_driver_trains_the_job_to_success(user, live_nodes, settings) -> None:
    settings.ARCEUS_DRIVER_LEASE_SECONDS = 1.5  # renewed from its thread every 0.5 s while it trains
    job = started_job(user, live_nodes)
    assert run_job(str(job.id)) == "succeeded"
    reconcile_once()  # the pass the driver's last word nudged
    job.refresh_from_db()
    assert job.status == "succeeded", job.error
    steps_per_epoch = 23  # ceil(1437 digits training samples / 64)
    assert job.step == job.total_steps == 2 * steps_per_epoch
    losses = list(LossPoint.objects.filter(job=job).order_by("step").values_list("loss", flat=True))
    assert len(losses) == job.step and losses[-1] < losses[0] / 2
    assert job.val_accuracy > 0.5  # ten classes: it learned
    assert list(EpochMetric.objects.filter(job=job).values_list("epoch", flat=True)) == [1, 2]
    for stage in Stage.objects.filter(job=job):
        assert stage.samples > 0 and stage.compute_seconds > 0 and not stage.active
    assert job.driver_lease_owner == ""
    # Idempotent: a redelivered message finds nothing to do.
    assert run_job(str(job.id)) == "skipped"


def test_the_jobs_schedule_and_transfer_reach_the_driver_and_the_agents(user, live_nodes) -> None:
    job = started_job(
        user, live_nodes, epochs=1, schedule="1f1b", transfer={"activations": "int8", "gradients": "int8"}
    )
    assert train_plan(job).schedule == "1f1b"
    assert run_job(str(job.id)) == "succeeded"
    reconcile_once()  # the pass the driver's last word nudged
    job.refresh_from_db()
    assert job.status == "succeeded", job.error
    losses = list(LossPoint.objects.filter(job=job).order_by("step").values_list("loss", flat=True))
    assert losses[-1] < losses[0] - 0.15  # it learns through 8-bit transfers
    # Stage 0 sent every training and validation sample's 32 activations: 4 bytes each in fp32, about
    # one byte (plus a float32 scale per 64 values) in int8.
    fp32_bytes = (1437 + 360) * 32 * 4
    first = Stage.objects.get(job=job, index=0)
    assert 0 < first.bytes_sent < 0.4 * fp32_bytes


def test_a_second_driver_exits_while_the_first_holds_the_lease(user, live_nodes) -> None:
    job = started_job(user, live_nodes)
    Job.objects.filter(pk=job.pk).update(
        driver_lease_owner="another-worker", driver_lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    assert run_job(str(job.id)) == "skipped"
    job.refresh_from_db()
    assert job.status == "running" and job.step == 0


def test_an_unreachable_stage_interrupts_the_driver_for_the_reconciler_to_decide(
    user, live_nodes, settings
) -> None:
    settings.ARCEUS_RPC_TIMEOUT_SECONDS = 2
    job = started_job(user, live_nodes)
    live_nodes[1].agent.stop(grace=0)
    assert run_job(str(job.id)) == "interrupted"
    job.refresh_from_db()
    # Still running, but the lease is given up at once (claimed, expired): the reconciler rewinds the job to its
    # last checkpoint once each stage's node is heard from since (in place) or counts lost (its stage moved).
    assert job.status == "running" and job.driver_lease_owner != ""
    assert job.driver_lease_expires_at <= timezone.now()
    training = next(c for c in job.conditions if c["type"] == "Training")
    assert training["reason"] == "DriverInterrupted" and "failed with UNAVAILABLE" in training["message"]


def test_nothing_to_do_for_a_job_that_is_not_running(user) -> None:
    job = job_submit(owner=user, **JOB)
    assert run_job(str(job.id)) == "skipped"
