"""The ledger: priced, append-only, idempotent entries per node and stage generation; prices posted from
demand and supply; hourly rollups; what owners and developers see through the API."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.counters import StageCounters
from controlplane.controller.executor import reconcile_once
from controlplane.controller.transitions import job_rewind
from controlplane.driver.progress import job_record_steps
from controlplane.jobs.leases import job_driver_claim
from controlplane.jobs.models import Job, Stage
from controlplane.market.models import LedgerEntry, LedgerHourly, PriceChange
from controlplane.market.services import ledger_rollup, prices_reprice
from controlplane.nodes.device_class import node_device_class
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_token_rotate

pytestmark = pytest.mark.django_db
DRIVER = "driver"


PLACED = timezone.now()  # when the stages were placed: the clock the ledger's held time is read on


@pytest.fixture
def running_job(ready_node, queued_job) -> Job:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i, flops=1.2e11, memory=16 * 2**30)
    job = queued_job()
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status="running")
    Stage.objects.filter(job=job).update(held_since=PLACED)
    assert job_driver_claim(job_id=job.id, owner=DRIVER, now=timezone.now()) is not None
    job.refresh_from_db()
    return job


def report(job: Job, samples: int, seconds: float) -> bool:
    """The driver records the three stages' cumulative counters (as after a step) `seconds` after the stages were
    placed."""
    counters = [StageCounters(i, samples, samples // 8, seconds * (i + 1), 1000 * samples, 900 * samples)
                for i in range(3)]
    return job_record_steps(job_id=job.id, lease_owner=DRIVER, points=[], stages=counters,
                            now=PLACED + timedelta(seconds=seconds))


def totals(**filters: object) -> dict:
    return LedgerEntry.objects.filter(**filters).aggregate(
        samples=Sum("samples"), seconds=Sum("compute_seconds"), held=Sum("held_seconds"), charge=Sum("charge_micros"),
        fee=Sum("fee_micros"), credit=Sum("credit_micros"),
    )


def test_entries_are_the_work_since_the_last_report_and_retries_add_nothing(running_job: Job) -> None:
    assert report(running_job, samples=320, seconds=36.0)
    assert LedgerEntry.objects.count() == 3
    assert report(running_job, samples=320, seconds=36.0)  # a retried write of the same counters
    assert LedgerEntry.objects.count() == 3
    assert report(running_job, samples=800, seconds=90.0)
    stage2 = LedgerEntry.objects.filter(stage_index=2).order_by("samples_total")
    assert [(e.samples, e.compute_seconds, e.samples_total) for e in stage2] == [(320, 108.0, 320), (480, 162.0, 800)]
    assert totals(stage_index=2)["samples"] == 800 and totals(stage_index=2)["seconds"] == pytest.approx(270.0)


def test_work_is_charged_at_the_price_in_force_and_credits_plus_fees_equal_charges(running_job: Job, settings) -> None:
    settings.ARCEUS_PLATFORM_FEE = 0.15
    klass = node_device_class(Node.objects.first())
    PriceChange.objects.create(device_class=klass, price_per_hour=0.36, demand=3, supply=3)
    report(running_job, samples=320, seconds=100.0)
    entry = LedgerEntry.objects.get(stage_index=0)
    assert (entry.device_class, entry.price_per_hour) == (klass, 0.36)
    assert entry.held_seconds == 100.0 and entry.charge_micros == 10_000  # 100 s held at $0.36/h = $0.01
    assert (entry.fee_micros, entry.credit_micros) == (1_500, 8_500)
    PriceChange.objects.create(device_class=klass, price_per_hour=0.72, demand=6, supply=3)
    report(running_job, samples=640, seconds=200.0)
    later = LedgerEntry.objects.filter(stage_index=0).order_by("samples_total").last()
    assert later.price_per_hour == 0.72 and later.charge_micros == 20_000
    t = totals()
    assert t["credit"] + t["fee"] == t["charge"]  # to the micro-dollar, not just the cent


def test_reports_worth_less_than_a_micro_dollar_each_add_up_without_rounding_drift(running_job: Job, settings) -> None:
    settings.ARCEUS_PLATFORM_FEE = 0.1
    klass = node_device_class(Node.objects.first())
    PriceChange.objects.create(device_class=klass, price_per_hour=0.36, demand=3, supply=3)
    # Stage 0 reports 0.005 s later after each of 100 steps: $0.0000005 of time held a report, 0.5 s in all.
    for step in range(1, 101):
        report(running_job, samples=32 * step, seconds=0.005 * step)
    t = totals(stage_index=0)
    assert t["held"] == pytest.approx(0.5)
    assert t["charge"] == 50  # 0.5 s at $0.36/h: what one report of 0.5 s would be charged
    assert t["fee"] == 5 and t["credit"] == 45
    assert all(e.credit_micros >= 0 for e in LedgerEntry.objects.all())


def test_a_rewound_stage_starts_a_new_generation_and_the_old_work_stays_counted(running_job: Job) -> None:
    report(running_job, samples=320, seconds=10.0)
    assert job_rewind(job_id=running_job.id, generation=running_job.generation, reason="DriverLost",
                      message="test", now=timezone.now())
    Job.objects.filter(pk=running_job.pk).update(status="running")
    running_job.refresh_from_db()
    assert job_driver_claim(job_id=running_job.id, owner=DRIVER, now=timezone.now()) is not None
    report(running_job, samples=96, seconds=13.0)  # the agents' counters start again at zero
    assert totals(stage_index=0)["samples"] == 320 + 96
    assert totals(stage_index=0)["held"] == 13.0  # the node was held all along, rewind included
    assert set(LedgerEntry.objects.values_list("generation", flat=True)) == {running_job.generation - 1,
                                                                             running_job.generation}


def test_a_driver_without_the_lease_records_nothing(running_job: Job) -> None:
    Job.objects.filter(pk=running_job.pk).update(driver_lease_owner="another")
    assert not report(running_job, samples=320, seconds=10.0)
    assert not LedgerEntry.objects.exists()


def test_prices_follow_demand_and_supply_and_every_change_is_kept(running_job: Job) -> None:
    [first] = prices_reprice()  # three devices of one class, a job wanting three
    assert (first.demand, first.supply, first.price_per_hour) == (3.0, 3.0, pytest.approx(0.30))
    assert prices_reprice() == []  # nothing moved, nothing posted
    Node.objects.filter(name="n2").update(paused=True)  # supply 2 for demand 3: dearer
    [second] = prices_reprice()
    assert second.supply == 2.0 and second.price_per_hour > first.price_per_hour
    assert PriceChange.objects.count() == 2


def test_every_class_of_registered_device_is_priced_as_measured(running_job: Job) -> None:
    Node.objects.filter(name="n1").update(flops_measured=1e9)  # timed far slower than it declared
    changes = prices_reprice()
    classes = {node_device_class(n) for n in Node.objects.filter(registered_at__isnull=False)}
    assert sorted(c.device_class for c in changes) == sorted(classes) == ["light-medium", "standard-medium"]
    assert {(c.demand, c.supply) for c in changes} == {(3.0, 3.0)}


def test_the_hourly_rollup_matches_the_ledger_and_can_run_again(running_job: Job) -> None:
    report(running_job, samples=320, seconds=36.0)
    report(running_job, samples=640, seconds=72.0)
    since = timezone.now() - timedelta(hours=2)
    assert ledger_rollup(since=since) == 3  # one row per node (one stage each) this hour
    assert ledger_rollup(since=since) == 3
    assert LedgerHourly.objects.count() == 3
    hourly = LedgerHourly.objects.aggregate(samples=Sum("samples"), credit=Sum("credit_micros"))
    assert (hourly["samples"], hourly["credit"]) == (totals()["samples"], totals()["credit"])


def test_owners_see_their_earnings_and_developers_their_cost(running_job: Job, api: APIClient, other_api) -> None:
    report(running_job, samples=320, seconds=3600.0)
    node = Stage.objects.get(job=running_job, index=0).node
    earnings = api.get(f"/api/nodes/{node.id}/earnings").json()
    expected = Decimal(LedgerEntry.objects.get(node=node).credit_micros) / 1_000_000
    assert Decimal(earnings["credit_usd"]) == expected > 0
    assert earnings["per_job"][0]["job_id"] == str(running_job.id) and earnings["per_day"][0]["samples"] == 320
    assert earnings["held_seconds"] == earnings["per_job"][0]["held_seconds"] == 3600.0  # what the credit pays for
    refused = other_api.get(f"/api/nodes/{node.id}/earnings")
    assert refused.status_code == 404 and refused.json()["detail"] == f"node {node.id} not found"
    # Its agent reads the same with its node token (`arceus-agent status`); a user's token is not an agent's.
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Node {node_token_rotate(node=node, user=node.owner)}")
    assert agent.get("/api/agent/earnings").json() == earnings
    assert api.get("/api/agent/earnings").status_code == 401

    cost = api.get(f"/api/jobs/{running_job.id}").json()["cost"]
    assert Decimal(cost["charged_usd"]) == Decimal(totals()["charge"]) / 1_000_000
    prices = api.get("/api/market/prices").json()
    assert [p["device_class"] for p in prices] == ["standard-medium"]
    assert prices[0]["price_per_hour"] == pytest.approx(0.30) and prices[0]["updated_at"] is None
    # What a developer's DistributedTrainer.discover_peers counts: devices that could take work now.
    assert prices[0]["ready_nodes"] == 3
    n0, n1, _ = Node.objects.order_by("name")
    Node.objects.filter(pk=n0.pk).update(paused=True)
    Node.objects.filter(pk=n1.pk).update(leaving_at=timezone.now())
    assert api.get("/api/market/prices").json()[0]["ready_nodes"] == 1


def test_a_running_job_shows_the_time_and_money_left(running_job: Job, api: APIClient) -> None:
    Job.objects.filter(pk=running_job.pk).update(step=10, total_steps=110, samples_per_second=64.0)
    cost = api.get(f"/api/jobs/{running_job.id}").json()["cost"]
    # 100 steps of 32 samples at 64 samples/s: 50 s on three laptops at $0.30/h each.
    assert cost["remaining_seconds"] == pytest.approx(50.0)
    assert Decimal(cost["estimate_to_finish_usd"]) == Decimal("0.0125")
    Job.objects.filter(pk=running_job.pk).update(status="succeeded")
    cost = api.get(f"/api/jobs/{running_job.id}").json()["cost"]
    assert cost["remaining_seconds"] is None and cost["estimate_to_finish_usd"] is None


def test_a_job_pays_per_second_held_and_charges_equal_credits_plus_fees(running_job: Job, settings) -> None:
    """Held time, not compute time: a stage that waits on its neighbours 90% of a step is paid for the whole step,
    like the stage that computes all of it; a node moved onto the job is paid from its move."""
    settings.ARCEUS_PLATFORM_FEE = 0.1
    klass = node_device_class(Node.objects.first())
    PriceChange.objects.create(device_class=klass, price_per_hour=0.36, demand=3, supply=3)
    report(running_job, samples=320, seconds=10.0)  # whatever each stage computed of those 10 s
    report(running_job, samples=640, seconds=30.0)
    for index in range(3):
        assert totals(stage_index=index)["held"] == 30.0 and totals(stage_index=index)["charge"] == 3_000
    moved_to = Node.objects.create(owner=Node.objects.first().owner, name="n3", flops_fp32=1.2e11,
                                   memory_bytes=16 * 2**30)
    Stage.objects.filter(job=running_job, index=1).update(node=moved_to, held_since=PLACED + timedelta(seconds=50))
    report(running_job, samples=960, seconds=60.0)
    assert totals(node=moved_to)["held"] == 10.0 and totals(node=moved_to)["charge"] == 1_000
    assert totals(stage_index=0)["held"] == 60.0
    t = totals()
    assert t["charge"] == 3 * 3_000 + 2 * 3_000 + 1_000  # 160 device-seconds at $0.36/h, to the micro-dollar
    assert t["credit"] + t["fee"] == t["charge"] and t["fee"] == 1_600


def test_what_is_left_to_pay_is_the_time_left_on_the_devices_held_at_their_prices(running_job: Job, api) -> None:
    """Charged so far and "to finish" are on one basis: three devices held 100 s for 10 steps, at a pace of 10 s a
    step; the 30 steps left hold them 300 s more."""
    klass = node_device_class(Node.objects.first())
    PriceChange.objects.create(device_class=klass, price_per_hour=0.36, demand=3, supply=3)
    report(running_job, samples=320, seconds=100.0)
    Job.objects.filter(pk=running_job.pk).update(step=10, total_steps=40, samples_per_second=3.2)
    cost = api.get(f"/api/jobs/{running_job.id}").json()["cost"]
    assert Decimal(cost["charged_usd"]) == Decimal("0.03")  # 3 x 100 s at $0.36/h
    assert cost["remaining_seconds"] == pytest.approx(300.0)
    assert Decimal(cost["estimate_to_finish_usd"]) == Decimal("0.09")  # 3 x 300 s at $0.36/h
    assert cost["budget_usd"] is None and cost["budget_remaining_usd"] is None


def test_a_job_is_never_charged_past_its_max_total_usd(running_job: Job, api) -> None:
    klass = node_device_class(Node.objects.first())
    PriceChange.objects.create(device_class=klass, price_per_hour=0.36, demand=3, supply=3)
    Job.objects.filter(pk=running_job.pk).update(requirements={"max_total_usd": 0.025})
    report(running_job, samples=320, seconds=50.0)  # 3 x $0.005
    cost = api.get(f"/api/jobs/{running_job.id}").json()["cost"]
    assert (Decimal(cost["budget_usd"]), Decimal(cost["budget_remaining_usd"])) == (Decimal("0.025"), Decimal("0.01"))
    report(running_job, samples=640, seconds=100.0)  # 3 x $0.005 more would pass the cap: cut to it
    t = totals()
    assert t["charge"] == 25_000 and t["credit"] + t["fee"] == t["charge"]
    assert Decimal(api.get(f"/api/jobs/{running_job.id}").json()["cost"]["budget_remaining_usd"]) == 0
