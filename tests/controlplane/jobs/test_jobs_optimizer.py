"""A job's optimizer reaches every stage's assignment and its placement's memory; 8-bit Adam refuses the
options whose state it cannot split or average."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from arceus.contracts.assignment import Assignment
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import assignments_for_node

pytestmark = pytest.mark.django_db


def test_8bit_adam_is_stored_and_reaches_every_assignment(api: APIClient, digits_job, ready_node) -> None:
    nodes = [ready_node(f"n{i}", port=50060 + i) for i in range(3)]
    response = api.post("/api/jobs", {**digits_job, "optimizer": "adam8bit"}, format="json")
    assert response.status_code == 201 and response.json()["optimizer"] == "adam8bit"
    job = Job.objects.get(pk=response.json()["id"])
    assert api.post(f"/api/jobs/{job.id}/train", {}, format="json").status_code == 202
    reconcile_once()
    for node in nodes:
        [assignment] = assignments_for_node(node=node)
        assert Assignment.from_json(assignment).optimizer.name == "adam8bit"


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"model_config": {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 8, "block_size": 8},
          "dataset_config": {"name": "text"}, "tensor_parallel": {"size": 2}}, "a tensor-parallel split would cut"),
        ({"replicas": {"min": 2, "max": 2}, "replica_sync": {"every_steps": 4}}, "cannot be averaged between replicas"),
        ({"optimizer": "lamb"}, "is not a valid choice"),
    ],
    ids=["tensor-parallel", "replicas-sync-every-4", "unknown"],
)
def test_an_optimizer_a_job_cannot_train_with_is_refused_naming_why(
    api: APIClient, digits_job, fields: dict, fragment: str
) -> None:
    response = api.post("/api/jobs", {**digits_job, "optimizer": "adam8bit", **fields}, format="json")
    assert response.status_code == 400
    assert fragment in response.json()["errors"]["optimizer"][0]
    assert not Job.objects.exists()
