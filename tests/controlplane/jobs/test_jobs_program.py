"""An exported model's program: only for an exported model, only before it trains, only the program its model
config names, every operator allowed; kept in checkpoint storage, named in the assignments, and each agent
served only the layers of the stage it hosts. Its job starts only with its program and weights uploaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from rest_framework.test import APIClient
from torch import nn

from arceus.contracts.assignment import Assignment
from arceus.model.exported.capture import CapturedModel, capture
from controlplane.common.errors import ApplicationError
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job
from controlplane.jobs.services import job_start, job_submit
from devtools.hostile_program import forged_program
from tests.controlplane.conftest import DIGITS_JOB
from tests.controlplane.jobs.test_jobs_checkpoints import agents, checkpoint_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def captured() -> CapturedModel:
    torch.manual_seed(0)
    return capture(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 10)), torch.rand(4, 64))


def submit(user, model_config: dict) -> Job:  # noqa: ANN001
    return job_submit(owner=user, **{**DIGITS_JOB, "model_config": model_config, "stages": 2})


def put(api: APIClient, job: Job, what: str, data: bytes) -> dict:
    response = api.put(f"/api/jobs/{job.id}/{what}", data, content_type="application/octet-stream")
    return {**response.json(), "http": response.status_code}


def test_the_program_is_kept_and_each_agent_gets_its_stages_layers(
    api: APIClient, user, captured: CapturedModel, agents, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    job = submit(user, captured.model_config)
    assert job.audit_rate == 0.0  # no spot checks of an exported model's stages
    with pytest.raises(ApplicationError, match="upload its program"):
        job_start(job=job)
    answer = put(api, job, "program", captured.program)
    assert answer["http"] == 200 and answer["program_sha256"] == captured.model_config["program_sha256"]
    assert put(api, job, "initial-weights", captured.weights)["http"] == 200
    job.refresh_from_db()
    assert (checkpoint_dir / job.program.name).read_bytes() == captured.program

    job_start(job=job)
    reconcile_once()
    served = []
    for _, client in agents:
        for raw in client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]:
            assignment = Assignment.from_json(raw)
            url = assignment.program
            assert url == f"/api/agent/jobs/{job.id}/program" and assignment.initial_weights is not None
            start, end = assignment.layer_start, assignment.layer_end
            answer = client.get(url, {"start": start, "end": end})
            assert answer.status_code == 200
            served.extend(answer.json()["layers"])
            layers = len(captured.model_config["layers"])
            assert client.get(url, {"start": 0, "end": layers}).status_code == 404  # not only its own layers
    assert sorted(served) == sorted(json.loads(captured.program)["layers"])  # every layer, once
    assert put(api, job, "program", captured.program)["http"] == 409  # started: too late


def test_a_program_that_is_not_the_jobs_or_runs_a_forbidden_operator_is_refused_and_not_kept(
    api: APIClient, other_api: APIClient, user, captured: CapturedModel, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    job = submit(user, captured.model_config)
    answer = put(api, job, "program", captured.program + b" ")
    assert answer["http"] == 400 and "model_config.program_sha256" in answer["errors"]["body"][0]
    config, _, forged = forged_program(captured, 2, "torch.ops.aten.from_file.default")
    answer = put(api, submit(user, config), "program", forged)
    assert answer["http"] == 400
    assert "uses operator aten::from_file" in answer["errors"]["program.layers[2]"][0]
    assert not any(p.is_file() for p in checkpoint_dir.rglob("*"))
    mlp = job_submit(owner=user, **DIGITS_JOB)
    assert "has no program" in put(api, mlp, "program", b"{}")["detail"]
    assert put(other_api, job, "program", captured.program)["http"] == 404


def test_a_program_nested_past_the_bound_is_a_400_not_a_crash(api: APIClient, user, captured: CapturedModel,  # noqa: ANN001
                                                              checkpoint_dir: Path) -> None:  # noqa: F811
    deep = b'{"format": "arceus.exported-program/1", "layers": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    job = submit(user, {**captured.model_config, "program_sha256": hashlib.sha256(deep).hexdigest()})
    answer = put(api, job, "program", deep)
    assert answer["http"] == 400 and "more than 32 deep" in answer["errors"]["program"][0]
    assert not any(p.is_file() for p in checkpoint_dir.rglob("*"))
