"""POST /api/jobs/estimate: the placement, speed, time and price a job would get now; nothing saved."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.jobs.models import Job
from controlplane.nodes.models import Node

pytestmark = pytest.mark.django_db


@pytest.fixture
def offered(ready_node) -> list[Node]:
    return [
        ready_node("fast", port=50051, flops=4e11, memory=16 * 2**30),
        ready_node("slow", port=50052, flops=1e11, memory=16 * 2**30),
        ready_node("tiny", port=50053, flops=1e11, memory=2**20),
    ]


def estimate(api: APIClient, job: dict, **changes: object) -> dict:
    response = api.post("/api/jobs/estimate", {**job, **changes}, format="json")
    assert response.status_code == 200, response.content
    return response.json()


def test_the_estimate_plans_prices_and_times_the_job_without_saving_it(api, digits_job, offered) -> None:
    body = estimate(
        api, digits_job, epochs=10, stages=None, requirements={"max_total_usd": 5, "min_memory_bytes": 2**30}
    )
    assert body["feasible"] and body["reason"] is None and body["candidates"] == 2  # "tiny" is too small
    assert [s["node_name"] for s in body["stages"]][0] == "fast"  # the fastest node leads
    assert body["stages"][0]["layer_start"] == 0 and body["stages"][-1]["layer_end"] == 3
    assert body["samples_per_second"] > 0 and body["hours"] > 0
    assert body["price_per_hour"] == pytest.approx(0.30 * len(body["stages"]))  # two laptops at the base price
    assert float(body["total_usd"]) == pytest.approx(body["price_per_hour"] * body["hours"], abs=1e-6)
    assert body["within_budget"] is True and body["meets_deadline"] is None
    assert not Job.objects.exists()


def test_a_job_that_cannot_be_placed_now_says_why(api, digits_job, offered) -> None:
    body = estimate(api, digits_job, requirements={"device_types": ["cuda"]})
    assert (body["feasible"], body["reason"], body["candidates"], body["stages"]) == (
        False, "no device is available", 0, []
    )
    body = estimate(api, digits_job, stages=None, requirements={"max_price_per_hour": 0.1})
    assert not body["feasible"] and "costs more than the budget of $0.1000/hour" in body["reason"]


def test_deadline_and_budget_verdicts(api, digits_job, offered) -> None:
    soon = (timezone.now() + timedelta(microseconds=1)).isoformat()  # passed before the estimate ends
    body = estimate(
        api, digits_job, epochs=10_000, stages=None, requirements={"deadline": soon, "max_total_usd": 0.000001}
    )
    assert body["feasible"] and body["meets_deadline"] is False and body["within_budget"] is False


@pytest.mark.parametrize(
    ("requirements", "field", "message"),
    [
        ({"device_types": ["tpu"]}, "requirements.device_types[0]", '"tpu" is not a valid choice.'),
        ({"device_types": []}, "requirements.device_types", "Ensure this field has at least 1 elements."),
        ({"min_devices": 3, "max_devices": 2}, "requirements.max_devices", "Must be at least min_devices."),
        ({"min_devices": 9}, "requirements.min_devices", "is 9 but the model has only 3 layers to spread"),
        ({"max_price_per_hour": 0}, "requirements.max_price_per_hour", "Must be greater than 0"),
        ({"budget": 3}, "requirements.budget", "Unknown field"),
    ],
)
def test_bad_requirements_are_refused_field_by_field(api, digits_job, requirements, field, message) -> None:
    for path in ("/api/jobs/estimate", "/api/jobs"):
        response = api.post(path, {**digits_job, "requirements": requirements}, format="json")
        assert response.status_code == 400, response.content
        assert any(message in m for m in response.json()["errors"][field]), response.json()
    assert not Job.objects.exists()


def test_submitted_requirements_are_kept_and_shown(api, digits_job) -> None:
    wanted = {"device_types": ["mps", "cpu", "cpu"], "min_devices": 2, "max_price_per_hour": 1.5}
    job = api.post("/api/jobs", {**digits_job, "requirements": wanted}, format="json").json()
    assert job["requirements"] == {"device_types": ["cpu", "mps"], "min_devices": 2, "max_price_per_hour": 1.5}
