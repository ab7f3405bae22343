"""A job's max_total_usd holds while it trains: the reconciler stops it, checkpointed, before its charges would pass
the cap, and the ledger never charges past it."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.counters import StageCounters
from controlplane.controller.executor import reconcile_once
from controlplane.driver.progress import StepPoint, job_record_steps
from controlplane.jobs.leases import job_driver_handover
from controlplane.jobs.models import Job, Stage
from controlplane.market.models import LedgerEntry, PriceChange
from controlplane.nodes.device_class import node_device_class
from controlplane.nodes.models import Node
from tests.controlplane.jobs import test_jobs_checkpoints as checkpoints
from tests.controlplane.jobs.test_jobs_checkpoints import DRIVER, save

agents, checkpoint_dir, running_job = checkpoints.agents, checkpoints.checkpoint_dir, checkpoints.running_job

pytestmark = pytest.mark.django_db

STEP = timedelta(seconds=0.25)  # each step holds the three devices this long: 3 x $0.001 at $14.40 an hour


def test_a_job_stops_checkpointed_at_its_cap_charged_no_more_than_it(
    running_job: Job, settings, api: APIClient  # noqa: ANN001
) -> None:
    settings.ARCEUS_JOB_STOP_SECONDS = STEP.total_seconds()  # it can stop within a step
    PriceChange.objects.create(device_class=node_device_class(Node.objects.first()), price_per_hour=14.4, demand=3,
                               supply=3)
    job = running_job
    Job.objects.filter(pk=job.pk).update(requirements={"max_total_usd": 0.0125})  # just above four steps' $0.012
    placed = timezone.now()
    Stage.objects.filter(job=job).update(held_since=placed)

    def step(n: int) -> None:
        counters = [StageCounters(i, 32 * n, 4 * n, 0.1 * n, 0, 0) for i in range(3)]
        assert job_record_steps(job_id=job.id, lease_owner=DRIVER, points=[StepPoint(1, n, 100, 1.0, 128.0)],
                                stages=counters, now=placed + n * STEP)

    for n in range(1, 4):
        step(n)
        reconcile_once(now=placed + n * STEP)
        job.refresh_from_db()
        assert (job.status, job.handover_requested) == ("running", False)  # room for another step
    step(4)
    reconcile_once(now=placed + 4 * STEP)  # $0.012 charged: the next step would pass the cap
    job.refresh_from_db()
    assert job.status == "running" and job.handover_requested
    [stopping] = [c for c in job.conditions if c["type"] == "Stopping"]
    assert stopping["reason"] == "BudgetExhausted"
    step(5)  # the driver finishes the step it was on before it sees the request: charged up to the cap only
    assert save(job, 5) is not None
    assert job_driver_handover(job_id=job.id, owner=DRIVER, step=5, now=placed + 5 * STEP)
    reconcile_once(now=placed + 5 * STEP + timedelta(seconds=0.1))

    job.refresh_from_db()
    assert job.status == "failed"
    [failed] = [c for c in job.conditions if c["type"] == "Failed"]
    assert failed["reason"] == "BudgetExhausted" and "stopped at its newest checkpoint" in failed["message"]
    assert job.checkpoints.order_by("-step").first().step == 5
    money = LedgerEntry.objects.filter(job=job).aggregate(
        charge=Sum("charge_micros"), fee=Sum("fee_micros"), credit=Sum("credit_micros")
    )
    assert money["charge"] == 12_500 and money["credit"] + money["fee"] == money["charge"]
    cost = api.get(f"/api/jobs/{job.id}").json()["cost"]
    assert Decimal(cost["charged_usd"]) == Decimal("0.0125") and Decimal(cost["budget_remaining_usd"]) == 0
