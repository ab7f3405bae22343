"""The driver leases of one process's drivers are renewed together (`LeaseRenewals`, `jobs_driver_renew`): a round
extends every lease still held in the same queries whatever their number, tells each driver whose lease is gone
once, and leaves alone a lease whose driver ended."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.driver.lease_renewals import LeaseRenewals
from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db

HOUR = 3600.0  # the renewing thread's own rounds never come within a test: each round here is called


@pytest.fixture
def leased(queued_job: Callable[..., Job]) -> Callable[[str], Job]:
    """make(owner) → a running job whose driver lease `owner` holds, expiring in a minute."""

    def make(owner: str) -> Job:
        job = queued_job()
        Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner=owner,
                                             driver_lease_expires_at=timezone.now() + timedelta(seconds=60))
        return Job.objects.get(pk=job.pk)

    return make


def expiry(job: Job) -> object:
    return Job.objects.values_list("driver_lease_expires_at", flat=True).get(pk=job.pk)


def test_a_round_renews_every_held_lease_and_tells_each_lost_driver_once(leased: Callable[[str], Job]) -> None:
    a, b, cancelled, taken = leased("driver-a"), leased("driver-b"), leased("driver-c"), leased("driver-d")
    Job.objects.filter(pk=cancelled.pk).update(status="cancelled")
    Job.objects.filter(pk=taken.pk).update(driver_lease_owner="a later driver")
    renewals, lost = LeaseRenewals(interval=lambda: HOUR), []
    before = {job.pk: expiry(job) for job in (cancelled, taken)}
    now = timezone.now() + timedelta(seconds=30)
    with ExitStack() as drivers:
        for job in (a, b, cancelled, taken):
            drivers.enter_context(renewals.renewing(job_id=str(job.pk), owner=job.driver_lease_owner,
                                                    on_lost=lambda job=job: lost.append(job.pk)))
        renewals.renew_round(now)
        renewals.renew_round(now + timedelta(seconds=1))
    lease = timedelta(seconds=settings.ARCEUS_DRIVER_LEASE_SECONDS)
    assert expiry(a) == expiry(b) == now + timedelta(seconds=1) + lease
    assert {job.pk: expiry(job) for job in (cancelled, taken)} == before  # another's lease is not touched
    assert sorted(lost) == sorted([cancelled.pk, taken.pk])  # each told once, in the first round


def test_a_round_costs_the_same_queries_for_many_leases_as_for_one(leased: Callable[[str], Job]) -> None:
    renewals = LeaseRenewals(interval=lambda: HOUR)
    queries = []
    with ExitStack() as drivers:
        for count in (1, 8):  # one lease, then nine
            for job in [leased(f"driver-{count}-{i}") for i in range(count)]:
                drivers.enter_context(renewals.renewing(job_id=str(job.pk), owner=job.driver_lease_owner,
                                                        on_lost=lambda: pytest.fail("a held lease was lost")))
            with CaptureQueriesContext(connection) as captured:
                renewals.renew_round(timezone.now())
            queries.append(len(captured))
    assert queries[0] == queries[1]


def test_a_driver_that_ended_is_no_longer_renewed(leased: Callable[[str], Job]) -> None:
    ended, running = leased("driver-ended"), leased("driver-running")
    renewals = LeaseRenewals(interval=lambda: HOUR)
    with renewals.renewing(job_id=str(running.pk), owner=running.driver_lease_owner, on_lost=lambda: None):
        with renewals.renewing(job_id=str(ended.pk), owner=ended.driver_lease_owner, on_lost=lambda: None):
            pass
        first = expiry(ended)
        renewals.renew_round(timezone.now() + timedelta(seconds=120))  # past both leases' expiry
    assert expiry(ended) == first
    assert expiry(running) > first
