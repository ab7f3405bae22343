"""Rolled-back steps: the job's owner is charged for each step once, the nodes that computed them honestly are
paid for what they computed (the platform pays for the lost pass), and the node whose restart caused the
rollback is not paid for the steps it lost."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.counters import StageCounters
from controlplane.controller.executor import reconcile_once
from controlplane.controller.transitions import job_rewind
from controlplane.driver.progress import StepPoint, job_finish, job_record_steps
from controlplane.jobs.leases import job_driver_claim
from controlplane.jobs.models import Job, Stage
from controlplane.market.models import LedgerEntry, PriceChange
from controlplane.nodes.device_class import node_device_class
from controlplane.nodes.models import Node
from devtools.pipeline import identity_for
from tests.controlplane.conftest import agent_register
from tests.controlplane.jobs import test_jobs_checkpoints as checkpoints
from tests.controlplane.jobs.test_jobs_checkpoints import DRIVER, save

# The checkpoint tests' fixtures: three Ready agents and a running job placed on them, its lease held by DRIVER.
agents, checkpoint_dir, running_job = checkpoints.agents, checkpoints.checkpoint_dir, checkpoints.running_job

pytestmark = pytest.mark.django_db

MICROS_PER_SECOND = 1_000  # at $3.60 an hour
FEE = Decimal("0.1")


class Clock:
    """The time the driver's records are made at: one second per step from the stages' placement."""

    def __init__(self) -> None:
        self.now = timezone.now()

    def tick(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def priced(running_job: Job, settings, clock: Clock) -> Job:  # noqa: ANN001
    settings.ARCEUS_PLATFORM_FEE = float(FEE)
    klass = node_device_class(Node.objects.first())
    PriceChange.objects.create(device_class=klass, price_per_hour=3.6, demand=3, supply=3)
    Stage.objects.filter(job=running_job).update(held_since=clock.now)
    return running_job


def train(job: Job, driver: str, steps: range, clock: Clock, *, resumed_at: int = 0) -> None:
    """The driver records each step (one second on the clock, one of compute on every stage) with the stages'
    counters, cumulative within this run, which resumed after step `resumed_at` (a rewound run's agents count from
    zero again)."""
    for step in steps:
        done = step - resumed_at
        counters = [StageCounters(i, 32 * done, 4 * done, float(done), 0, 0) for i in range(3)]
        assert job_record_steps(job_id=job.id, lease_owner=driver, points=[StepPoint(1, step, 4, 1.0, 10.0)],
                                stages=counters, now=clock.tick())


def resume(job: Job, driver: str) -> Job:
    """The rewound job's stages are rebuilt and a new driver takes the lease."""
    Job.objects.filter(pk=job.pk).update(status="running")
    assert job_driver_claim(job_id=job.id, owner=driver, now=timezone.now()) is not None
    return Job.objects.get(pk=job.pk)


def restart(job: Job, agents: list[tuple[Node, APIClient]], *, index: int) -> Node:
    """The agent hosting stage `index` registers again (a fresh process), through the agent API; the reconciler's
    pass that the registration nudged follows."""
    node = Stage.objects.get(job=job, index=index).node
    [client] = [c for n, c in agents if n.pk == node.pk]
    body = {"grpc_address": node.grpc_address, "tls_certificate": identity_for(node.grpc_address).certificate,
            "capabilities": {"device_type": "cpu", "device_name": "test cpu", "memory_bytes": 2**30, "flops_fp32": 1e9}}
    assert agent_register(client, body).status_code == 200
    reconcile_once()
    return node


def dollars(micros: int) -> Decimal:
    return Decimal(micros) / 1_000_000


def earned(node: Node) -> int:
    return LedgerEntry.objects.filter(node=node, withheld=False).aggregate(c=Sum("credit_micros"))["c"]


def test_a_node_that_restarts_mid_job_is_not_paid_for_the_lost_steps_and_the_owner_pays_each_step_once(
    priced: Job, agents, api: APIClient, clock: Clock  # noqa: ANN001
) -> None:
    job = priced
    train(job, DRIVER, range(1, 3), clock)
    save(job, 2)
    train(job, DRIVER, range(3, 5), clock)  # steps 3 and 4, lost when...
    restarted = restart(job, agents, index=1)  # ...stage 1's agent restarts
    job.refresh_from_db()
    assert job.step == 2 and job.resume_checkpoint.step == 2

    job = resume(job, "driver-b")
    train(job, "driver-b", range(3, 5), clock, resumed_at=2)  # steps 3 and 4 again
    assert job_finish(job_id=job.id, lease_owner="driver-b", final_loss=1.0, val_loss=1.0, val_accuracy=0.5,
                      stages=[], now=timezone.now())

    # The owner pays one pass: 4 steps x 3 stages x 1 s, to the micro-dollar.
    charged = LedgerEntry.objects.filter(job=job).aggregate(c=Sum("charge_micros"))["c"]
    assert dollars(charged) == Decimal("0.012") == dollars(4 * 3 * MICROS_PER_SECOND)
    cost = api.get(f"/api/jobs/{job.id}").json()["cost"]
    assert Decimal(cost["charged_usd"]) == Decimal("0.012")
    # The restarted node is paid for the 4 steps that count, not for the 2 it lost.
    assert dollars(earned(restarted)) == 4 * dollars(MICROS_PER_SECOND) * (1 - FEE) == Decimal("0.0036")
    # The honest nodes are paid for all 6 steps they computed; the platform pays for the 2 lost ones.
    for index in (0, 2):
        honest = Stage.objects.get(job=job, index=index).node
        assert dollars(earned(honest)) == 6 * dollars(MICROS_PER_SECOND) * (1 - FEE) == Decimal("0.0054")
        earnings = api.get(f"/api/nodes/{honest.id}/earnings").json()
        assert Decimal(earnings["credit_usd"]) == Decimal("0.0054") and earnings["samples"] == 6 * 32
    fees = LedgerEntry.objects.filter(job=job).aggregate(f=Sum("fee_micros"))["f"]
    assert dollars(fees) == FEE * Decimal("0.012") - 2 * Decimal("0.0018") == Decimal("-0.0024")
    assert Decimal(cost["platform_fee_usd"]) == Decimal("-0.0024")
    # Each lost entry was reversed once, by an entry of money only.
    reversals = LedgerEntry.objects.filter(job=job, reverses__isnull=False)
    assert sorted(reversals.values_list("stage_index", "step")) == [(i, s) for i in range(3) for s in (3, 4)]
    assert all(r.samples == 0 and r.compute_seconds == 0 for r in reversals)


def test_a_rewind_nobody_caused_refunds_the_owner_and_pays_every_node(priced: Job, clock: Clock) -> None:
    """A driver that died (or a node lost to a crash) costs the platform the lost steps, not the owner."""
    job = priced
    train(job, DRIVER, range(1, 4), clock)
    save(job, 3)
    train(job, DRIVER, range(4, 6), clock)
    assert job_rewind(job_id=job.id, generation=job.generation, reason="DriverLost", message="test",
                      now=timezone.now())
    assert job_rewind(job_id=job.id, generation=job.generation + 1, reason="DriverLost", message="again",
                      now=timezone.now())  # nothing more was recorded: nothing more to reverse
    job = resume(job, "driver-b")
    train(job, "driver-b", range(4, 6), clock, resumed_at=3)

    charged = LedgerEntry.objects.filter(job=job).aggregate(c=Sum("charge_micros"))["c"]
    assert charged == 5 * 3 * MICROS_PER_SECOND
    assert LedgerEntry.objects.filter(reverses__isnull=False).count() == 3 * 2
    for stage in Stage.objects.filter(job=job):
        assert dollars(earned(stage.node)) == 7 * dollars(MICROS_PER_SECOND) * (1 - FEE)


def test_a_restart_that_fails_the_job_is_not_paid_and_the_owner_pays_only_what_was_saved(
    priced: Job, agents, settings, clock: Clock  # noqa: ANN001
) -> None:
    settings.ARCEUS_JOB_MAX_RESTARTS = 2
    job = priced
    train(job, DRIVER, range(1, 2), clock)
    save(job, 1)
    train(job, DRIVER, range(2, 4), clock)
    Job.objects.filter(pk=job.pk).update(restarts=2)  # restarted twice since the checkpoint: no more allowed
    culprit = restart(job, agents, index=2)
    job.refresh_from_db()
    assert job.status == "failed"
    assert LedgerEntry.objects.filter(job=job).aggregate(c=Sum("charge_micros"))["c"] == 3 * MICROS_PER_SECOND
    assert dollars(earned(culprit)) == dollars(MICROS_PER_SECOND) * (1 - FEE)  # step 1 only
    for stage in Stage.objects.filter(job=job).exclude(node=culprit):
        assert dollars(earned(stage.node)) == 3 * dollars(MICROS_PER_SECOND) * (1 - FEE)
