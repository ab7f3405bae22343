"""A job may ask its stages to recompute activations, or placement chooses it where a stage would not fit otherwise;
its assignments say so; tensor-parallel jobs cannot."""

from __future__ import annotations

from dataclasses import replace

import pytest
from rest_framework.test import APIClient

from arceus.contracts.assignment import Assignment
from arceus.model.registry import model_spec_from_config
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import stage_memory
from controlplane.controller.executor import reconcile_once
from controlplane.controller.placement import workload
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import assignments_for_node

pytestmark = pytest.mark.django_db


def test_the_setting_is_stored_and_reaches_every_assignment(api: APIClient, digits_job, ready_node) -> None:
    nodes = [ready_node(f"n{i}", port=50060 + i) for i in range(3)]
    response = api.post("/api/jobs", {**digits_job, "activation_checkpointing": True}, format="json")
    assert response.status_code == 201 and response.json()["activation_checkpointing"] is True
    job = Job.objects.get(pk=response.json()["id"])
    assert api.post(f"/api/jobs/{job.id}/train", {}, format="json").status_code == 202
    reconcile_once()
    for node in nodes:
        [assignment] = assignments_for_node(node=node)
        assert Assignment.from_json(assignment).activation_checkpointing is True


def test_a_tensor_parallel_job_cannot_recompute(api: APIClient) -> None:
    body = {
        "model_config": {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 8, "block_size": 8},
        "dataset_config": {"name": "text"}, "tensor_parallel": {"size": 2}, "activation_checkpointing": True,
    }
    response = api.post("/api/jobs", body, format="json")
    assert response.status_code == 400
    assert "cannot recompute" in response.json()["errors"]["activation_checkpointing"][0]
    assert not Job.objects.exists()


def test_a_job_whose_stage_fits_only_recomputing_is_placed_recomputing(api: APIClient, ready_node) -> None:
    # Eight blocks, whose stash (16 MiB each for the batch) recomputing trades for their inputs and one block's.
    body = {"model_config": {"type": "transformer", "n_layer": 8, "n_head": 2, "d_model": 64, "block_size": 128},
            "dataset_config": {"name": "text", "batch_size": 32}, "stages": 1, "optimizer": "adam",
            "requirements": {"owner_diversity": False}}
    response = api.post("/api/jobs", body, format="json")
    assert response.status_code == 201 and response.json()["activation_checkpointing"] is False
    job = Job.objects.get(pk=response.json()["id"])
    layers = layer_profiles(model_spec_from_config(job.model_config))
    steps = workload(job.dataset_config, job.micro_batches, job.schedule)
    recomputing = stage_memory(layers, replace(steps, activation_checkpointing=True))
    assert recomputing < stage_memory(layers, steps)
    node = ready_node("n0", port=50060, memory=recomputing)
    assert api.post(f"/api/jobs/{job.id}/train", {}, format="json").status_code == 202
    reconcile_once()
    job.refresh_from_db()
    assert job.activation_checkpointing is True
    [assignment] = assignments_for_node(node=node)
    assert Assignment.from_json(assignment).activation_checkpointing is True
