"""A job's uploaded initial weights (fine-tuning): only a model with a Hugging Face format, only before it
trains, only exactly the model's parameters; kept in the checkpoint storage, named in its assignments, and
served to the agents hosting the job only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rest_framework.test import APIClient
from safetensors.torch import save

from arceus.checkpoint import checkpoint_digest
from arceus.contracts.assignment import Assignment
from arceus.model.build import build_full_model, named_global_parameters
from arceus.model.llama.hf import hf_name
from arceus.model.registry import model_spec_from_config
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job
from controlplane.jobs.services import job_start, job_submit
from tests.controlplane.conftest import DIGITS_JOB
from tests.controlplane.jobs.test_jobs_checkpoints import agents, checkpoint_dir, download  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db

LLAMA = {
    "type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
    "max_position_embeddings": 8,
}


@pytest.fixture
def llama_job(user) -> Job:  # noqa: ANN001
    return job_submit(
        owner=user, **{**DIGITS_JOB, "model_config": LLAMA, "dataset_config": {"name": "text", "batch_size": 4}}
    )


def weights_file(job: Job, **changes: torch.Tensor | None) -> bytes:
    """The job's model under transformers' names (another seed's weights), with `changes` (None: left out)."""
    spec = model_spec_from_config(job.model_config)
    tensors = {hf_name(spec, n): p.detach() for n, p in named_global_parameters(build_full_model(spec, seed=11))}
    for name, value in changes.items():
        tensors.pop(name.replace("__", "."), None)
        if value is not None:
            tensors[name.replace("__", ".")] = value
    return save(tensors)


def put(api: APIClient, job: Job, data: bytes) -> dict:
    response = api.put(f"/api/jobs/{job.id}/initial-weights", data, content_type="application/octet-stream")
    return {**response.json(), "http": response.status_code}


def test_the_owner_uploads_weights_the_job_starts_from(
    api: APIClient, llama_job: Job, agents, checkpoint_dir: Path, django_capture_on_commit_callbacks  # noqa: ANN001, F811
) -> None:
    data = weights_file(llama_job)
    answer = put(api, llama_job, data)
    assert answer["http"] == 200 and answer["initial_weights_sha256"] == checkpoint_digest(data)
    llama_job.refresh_from_db()
    assert (checkpoint_dir / llama_job.initial_weights.name).read_bytes() == data
    # A second upload replaces the first (and its file goes).
    first = checkpoint_dir / llama_job.initial_weights.name
    with django_capture_on_commit_callbacks(execute=True):
        assert put(api, llama_job, data)["http"] == 200
    assert not first.exists()

    job_start(job=llama_job)
    reconcile_once()
    for _, client in agents:
        assignments = client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]
        for raw in assignments:
            ref = Assignment.from_json(raw).initial_weights
            assert ref is not None and raw["checkpoint"] is None
            assert download(client, ref.url).body == data and ref.sha256 == checkpoint_digest(data)
    hosts = {str(n) for n in llama_job.stages.values_list("node_id", flat=True)}
    idle = [client for node, client in agents if str(node.id) not in hosts]
    url = f"/api/agent/jobs/{llama_job.id}/initial-weights"
    for client in idle:  # a node that hosts none of the job's stages gets nothing
        assert download(client, url).status_code == 404
    assert put(api, llama_job, data)["http"] == 409  # started: too late


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lm_head__weight": None}, "the weights lack lm_head.weight"),
        ({"extra__weight": torch.zeros(2)}, "extra.weight is no parameter of this model"),
        ({"model__norm__weight": torch.ones(17)}, "model.norm.weight is torch.float32 [17]; the model's is"),
        ({"model__norm__weight": torch.ones(16, dtype=torch.bfloat16)}, "torch.bfloat16 [16]"),
    ],
)
def test_weights_that_are_not_exactly_the_models_are_refused_and_not_kept(
    api: APIClient, llama_job: Job, checkpoint_dir: Path, changes: dict, message: str  # noqa: F811
) -> None:
    answer = put(api, llama_job, weights_file(llama_job, **changes))
    assert answer["http"] == 400 and message in answer["errors"]["body"][0]
    assert not any(p.is_file() for p in checkpoint_dir.rglob("*"))
    assert put(api, llama_job, b"not safetensors")["http"] == 400


def test_a_model_without_a_hugging_face_format_and_anothers_job_are_refused(
    api: APIClient, other_api: APIClient, user, llama_job: Job, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    mlp = job_submit(owner=user, **DIGITS_JOB)
    answer = put(api, mlp, b"x")
    assert answer["http"] == 400 and "a model of type 'mlp' cannot start from uploaded weights" in answer["detail"]
    assert put(other_api, llama_job, weights_file(llama_job))["http"] == 404
