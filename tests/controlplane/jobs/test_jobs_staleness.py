"""A job's `staleness` (PipeDream-2BW, arceus.pipeline.schedule.STALENESS): checked at submit and estimate with errors
naming the field, refused where it is not supported, shown by the API, sent in every stage's assignment and counted
by the memory the reconciler places by."""

from __future__ import annotations

from dataclasses import replace

import pytest

from arceus.contracts.assignment import Assignment
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import placed_stage_memory, stale_weights_bytes
from controlplane.common.errors import ApplicationError
from controlplane.controller.executor import reconcile_once
from controlplane.controller.snapshot import load_snapshot
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import assignments_for_node
from controlplane.jobs.services import job_staleness_check, job_start
from tests.controlplane.conftest import DIGITS_JOB

UNREFUSED = {"replicas": {"min": 1, "max": 1}, "tensor_parallel": {}, "audit_rate": None, "ships_program": False}


def test_staleness_is_0_or_1_and_refused_where_it_is_not_supported(api) -> None:
    def refused(**fields: object) -> dict:
        response = api.post("/api/jobs", {**DIGITS_JOB, **fields}, format="json")
        assert response.status_code == 400, response.content
        return response.json()["errors"]

    assert "must be 0 (synchronous) or 1" in refused(staleness=2)["staleness"][0]
    assert "must be 0 (synchronous) or 1" in refused(staleness=-1)["staleness"][0]
    assert "integer" in refused(staleness=True)["staleness"][0]
    assert "integer" in refused(staleness="1")["staleness"][0]
    assert "replicated stages" in refused(staleness=1, replicas=2)["staleness"][0]
    assert "spot checks" in refused(staleness=1, audit_rate=0.1)["staleness"][0]
    for fields, named in (({"tensor_parallel": {"size": 2}}, "a tensor-parallel split"),
                          ({"ships_program": True}, "an exported model")):
        with pytest.raises(ApplicationError, match=f"not supported with {named}"):
            job_staleness_check(1, **{**UNREFUSED, **fields})
    assert job_staleness_check(1, **UNREFUSED) == 1
    estimate = api.post("/api/jobs/estimate", {**DIGITS_JOB, "staleness": 1, "replicas": 2}, format="json")
    assert estimate.status_code == 400 and "replicated stages" in estimate.json()["errors"]["staleness"][0]
    # Spot checks are off by default with staleness 1 (they read the weights a step used); 0 is the default.
    stale = api.post("/api/jobs", {**DIGITS_JOB, "staleness": 1}, format="json")
    assert stale.status_code == 201, stale.content
    assert stale.json()["staleness"] == 1 and stale.json()["audit_rate"] == 0.0
    assert api.post("/api/jobs", DIGITS_JOB, format="json").json()["staleness"] == 0


def test_a_stale_jobs_stages_are_told_and_placed_with_the_second_weights_version(api, ready_node) -> None:
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(3)]
    created = api.post("/api/jobs", {**DIGITS_JOB, "staleness": 1, "schedule": "1f1b"}, format="json")
    job = job_start(job=Job.objects.get(pk=created.json()["id"]))
    reconcile_once()
    assignments = [Assignment.from_json(a) for node in nodes for a in assignments_for_node(node=node)]
    assert sorted(a.stage_index for a in assignments) == [0, 1, 2]
    assert {a.staleness for a in assignments} == {1}
    desired, _ = load_snapshot()
    [view] = [j for j in desired.jobs if j.id == str(job.id)]
    assert view.workload.staleness == 1
    synchronous = replace(view.workload, staleness=0)
    for a in assignments:
        layers = layer_profiles(a.spec)[a.layer_start : a.layer_end]
        stale_need = placed_stage_memory(layers, view.workload, a.stage_index, 3)
        need = placed_stage_memory(layers, synchronous, a.stage_index, 3)
        assert stale_need >= need + stale_weights_bytes(layers) > need
