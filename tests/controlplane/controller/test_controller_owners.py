"""Owner diversity through the whole reconcile pass and the estimate: on a market where one owner holds every Ready
node a job waits with a condition saying why, and the estimate says so too; another owner's node lets it in."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

from controlplane.common.conditions import get_condition
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db


def test_a_job_waits_while_one_owner_holds_every_ready_node(ready_node, queued_job, estimate_of, digits_job) -> None:
    for i in range(4):
        ready_node(f"alice-{i}", port=50061 + i)
    spec = {**digits_job, "requirements": {}}  # the default: owner diversity
    job = queued_job(requirements={})
    reconcile_once()
    job.refresh_from_db()
    assert job.status == "queued" and not job.stages.exists()
    placed = get_condition(job.conditions, "Placed")
    assert (placed["status"], placed["reason"]) == ("False", "WaitingForOwners")
    assert "belongs to one owner" in placed["message"] and "owner_diversity false" in placed["message"]
    answer = estimate_of(spec)["result"]
    assert not answer["feasible"] and "belongs to one owner" in answer["reason"]

    ready_node("bob-0", port=50071, owner=User.objects.create_user("bob"))
    reconcile_once()
    job.refresh_from_db()
    assert job.status == "placing"
    owners = {stage.node.owner.username for stage in job.stages.filter(active=True).select_related("node__owner")}
    assert owners == {"alice", "bob"}
    assert Job.objects.count() == 1
