"""The jobs admin: pages are read-only; cancel and start run the jobs services and say what each did."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from arceus.contracts.status import JobStatus
from controlplane.agents.services import node_heartbeat
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db
CHANGELIST = "/admin/jobs/job/"


def act(client: Client, action: str, *jobs: Job) -> list[str]:
    """Run an admin action on the changelist; the messages the next page shows."""
    response = client.post(CHANGELIST, {"action": action, "_selected_action": [j.pk for j in jobs]}, follow=True)
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def test_cancel_ends_the_job_through_the_service_and_its_nodes_get_no_stage(operator: Client, running_job: Job) -> None:
    nodes = [stage.node for stage in running_job.stages.all()]
    assert all(node_heartbeat(node=n, observed=[], now=timezone.now()).assignments for n in nodes)  # each hosts a stage

    assert act(operator, "cancel", running_job) == [f"{running_job}: cancelled"]

    job = Job.objects.get(pk=running_job.pk)
    assert job.status == JobStatus.CANCELLED and job.finished_at is not None
    training = next(c for c in job.conditions if c["type"] == "Training")
    assert (training["reason"], training["message"]) == ("Cancelled", "cancelled by operator operator")
    assert all(node_heartbeat(node=n, observed=[], now=timezone.now()).assignments == [] for n in nodes)  # dropped
    assert LogEntry.objects.get(object_id=str(job.pk)).get_change_message() == "cancelled"


def test_each_job_is_reported_on_its_own(operator: Client, running_job: Job, queued_job) -> None:  # noqa: ANN001
    done = queued_job(name="done")
    act(operator, "cancel", done)
    messages = act(operator, "cancel", running_job, done)
    assert f"{running_job}: cancelled" in messages
    assert f"{done}: job {done.id} already cancelled; there is nothing to cancel" in messages
    assert Job.objects.get(pk=running_job.pk).status == JobStatus.CANCELLED


def test_start_retries_a_cancelled_job_from_scratch(operator: Client, running_job: Job) -> None:
    act(operator, "cancel", running_job)
    assert act(operator, "start", running_job) == [
        f"{running_job}: queued for placement (training starts from scratch)"
    ]
    assert Job.objects.get(pk=running_job.pk).status == JobStatus.QUEUED
    # A running job cannot be started: the service's refusal is what the operator reads.
    reconcile_once()
    Job.objects.filter(pk=running_job.pk).update(status="running")
    [refused] = act(operator, "start", running_job)
    assert "only a created, failed or cancelled job can be started" in refused


def test_the_change_form_is_read_only(operator: Client, running_job: Job) -> None:
    page = operator.get(f"{CHANGELIST}{running_job.pk}/change/")
    assert page.status_code == 200
    assert b'name="status"' not in page.content and b'name="model_config"' not in page.content
    posted = operator.post(f"{CHANGELIST}{running_job.pk}/change/", {"status": "succeeded", "generation": 99,
                                                                     "model_config": "{}", "transfer": "{}"})
    assert posted.status_code == 403
    job = Job.objects.get(pk=running_job.pk)
    assert (job.status, job.generation, job.model_config) == (
        running_job.status, running_job.generation, running_job.model_config
    )
    assert operator.get(f"{CHANGELIST}add/").status_code == 403
    assert operator.post(f"{CHANGELIST}{running_job.pk}/delete/", {"post": "yes"}).status_code == 403
    assert Job.objects.filter(pk=running_job.pk).exists()


def test_staff_who_may_only_view_jobs_cannot_cancel_them(running_job: Job) -> None:
    viewer = User.objects.create_user("viewer", password="viewer-password", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client = Client()
    client.force_login(viewer)
    assert client.get(CHANGELIST).status_code == 200
    client.post(CHANGELIST, {"action": "cancel", "_selected_action": [running_job.pk]})
    assert Job.objects.get(pk=running_job.pk).status == JobStatus.RUNNING


def test_the_list_shows_progress_and_cost_and_finds_a_job_by_id(operator: Client, running_job: Job) -> None:
    page = operator.get(CHANGELIST, {"q": str(running_job.id)})
    assert page.status_code == 200
    assert list(page.context["cl"].result_list) == [running_job]
    assert b"0.000000" in page.content and b"0/" in page.content  # nothing charged yet; step 0 of the total
    assert operator.get(CHANGELIST, {"status__exact": "running"}).context["cl"].result_count == 1
