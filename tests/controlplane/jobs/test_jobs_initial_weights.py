"""A job's uploaded initial weights (fine-tuning): only a model with a Hugging Face format, only before it
trains, only exactly the model's parameters; kept in the checkpoint storage, named in its assignments, and
served to the agents hosting the job only."""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlencode

import pytest
import torch
from django.apps import apps as django_apps
from django.utils import timezone
from rest_framework.test import APIClient
from safetensors.torch import load as safetensors_load
from safetensors.torch import save, save_file

from arceus.checkpoint import checkpoint_digest
from arceus.contracts.assignment import Assignment
from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.hugging_face import SHARDS_INDEX, initial_weights_layer_digests, initial_weights_slice_check
from arceus.model.llama.hf import hf_config, hf_name
from arceus.model.registry import model_spec_from_config
from arceus.safetensors_file import tensor_layouts
from controlplane.accounts.services import user_token_get_or_create
from controlplane.agents.services import node_heartbeat
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.services import job_start, job_submit
from tests.controlplane.conftest import DIGITS_JOB
from tests.controlplane.jobs.test_jobs_checkpoints import (  # noqa: F401 (fixtures)
    agents,
    checkpoint_dir,
    download,
    s3_bucket,
)

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
    spec = model_spec_from_config(llama_job.model_config)
    assert llama_job.initial_weights_layer_sha256 == initial_weights_layer_digests(spec, io.BytesIO(data), len(data))
    # A second upload replaces the first (and its file goes).
    first = checkpoint_dir / llama_job.initial_weights.name
    with django_capture_on_commit_callbacks(execute=True):
        assert put(api, llama_job, data)["http"] == 200
    assert not first.exists()

    job_start(job=llama_job)
    reconcile_once()
    assert put(api, llama_job, data)["http"] == 409  # started: too late


def query(url: str, params: dict) -> str:
    return f"{url}?{urlencode(params)}"


def stage_slice(client: APIClient, raw: dict) -> tuple[bytes, Assignment]:  # noqa: F811
    """What a hosting agent downloads for an assignment of its: its layers of the initial weights, checked."""
    assignment = Assignment.from_json(raw)
    ref, start, end = assignment.initial_weights, assignment.layer_start, assignment.layer_end
    assert ref is not None and raw["checkpoint"] is None
    response = download(client, query(ref.url, {"start": start, "end": end}))
    assert response.status_code == 200, response.content
    assert int(response["Content-Length"]) == len(response.body)
    initial_weights_slice_check(io.BytesIO(response.body), len(response.body), start, ref.layer_sha256)
    return response.body, assignment


def test_each_hosting_agent_downloads_only_its_stages_layers_under_the_pipelines_names(
    api: APIClient, llama_job: Job, agents, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    data = weights_file(llama_job)
    assert put(api, llama_job, data)["http"] == 200
    job_start(job=llama_job)
    reconcile_once()
    spec = model_spec_from_config(llama_job.model_config)
    uploaded = safetensors_load(data)
    received: list[str] = []
    for _, client in agents:
        for raw in client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]:
            body, assignment = stage_slice(client, raw)
            assert len(body) < len(data)
            tensors = safetensors_load(body)
            stage = build_layers(spec, assignment.layer_start, assignment.layer_end, seed=0)
            assert sorted(tensors) == sorted(n for n, _ in named_global_parameters(stage))
            for name, tensor in tensors.items():
                assert torch.equal(tensor, uploaded[hf_name(spec, name)]), name
            received += tensors
    assert len(received) == len(set(received)) == len(uploaded)


def test_only_a_host_of_those_layers_gets_them_and_a_bad_range_is_named(
    api: APIClient, user, agents, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    llama_job = job_submit(
        owner=user,
        **{**DIGITS_JOB, "model_config": LLAMA, "dataset_config": {"name": "text", "batch_size": 4}, "stages": 2},
    )
    assert put(api, llama_job, weights_file(llama_job))["http"] == 200
    job_start(job=llama_job)
    reconcile_once()
    url = f"/api/agent/jobs/{llama_job.id}/initial-weights"
    stages = {str(s.node_id): s for s in llama_job.stages.filter(active=True)}
    hosts = [(stages[str(n.id)], c) for n, c in agents if str(n.id) in stages]
    idle = [c for n, c in agents if str(n.id) not in stages]
    assert len(hosts) == 2 and len(idle) == 1
    (stage, host), (other, _) = hosts[0], hosts[1]
    ok = {"start": stage.layer_start, "end": stage.layer_end}
    for client in idle:  # a node hosting none of the job's stages learns nothing, not even what it asked wrong
        assert download(client, query(url, ok)).status_code == 404
        assert download(client, query(url, {"start": "x"})).status_code == 404
    assert download(host, query(f"/api/agent/jobs/{uuid.uuid4()}/initial-weights", ok)).status_code == 404
    for params, field, message in [
        ({"end": stage.layer_end}, "start", "must be a layer index"),
        ({**ok, "start": "-1"}, "start", "must be a layer index"),
        ({**ok, "end": "1e3"}, "end", "must be a layer index"),
        ({"start": stage.layer_end, "end": stage.layer_start}, "end", "must be above start"),
        ({"start": 0, "end": 99}, "end", "the model has 4 layers"),
    ]:
        response = host.get(url, params)
        assert response.status_code == 400 and message in response.json()["errors"][field][0], (params, response.json())
    other_layers = {"start": other.layer_start, "end": other.layer_end}
    assert download(host, query(url, other_layers)).status_code == 404  # another stage's layers
    assert download(host, query(url, ok)).status_code == 200
    Stage.objects.filter(pk=stage.pk).update(generation=stage.generation - 1)  # no longer the current generation
    assert download(host, query(url, ok)).status_code == 404


def test_uploaded_weights_in_an_s3_bucket_are_read_by_range(
    api: APIClient, llama_job: Job, agents, s3_bucket  # noqa: ANN001, F811
) -> None:
    data = weights_file(llama_job)
    assert put(api, llama_job, data)["http"] == 200
    llama_job.refresh_from_db()
    assert [o["Key"] for o in s3_bucket.list_objects_v2(Bucket="arceus-checkpoints")["Contents"]] == [
        llama_job.initial_weights.name
    ]
    job_start(job=llama_job)
    for node, _ in agents:  # the upload took seconds on a busy machine: the nodes are still alive
        node_heartbeat(node=node, observed=[], now=timezone.now())
    reconcile_once()
    client = next(c for n, c in agents if llama_job.stages.filter(node=n, active=True, index=0).exists())
    [raw] = client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]
    body, assignment = stage_slice(client, raw)
    stage = build_layers(model_spec_from_config(llama_job.model_config), 0, assignment.layer_end, seed=0)
    assert len(body) < len(data)
    assert sorted(safetensors_load(body)) == sorted(n for n, _ in named_global_parameters(stage))


# The uploader's code, run as its own process: its peak RSS (VmHWM) after the imports and after the upload.
_MEASURED_CLI = """
import re, sys
from arceus.cli import main
def peak(): return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
before = peak()
code = main(sys.argv[1:])
print(before, peak(), code)
"""


@pytest.mark.django_db(transaction=True)
def test_a_sharded_bf16_folder_uploads_streaming_the_uploader_never_holds_it(
    live_server, user, tmp_path: Path, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    """`arceus jobs weights` of a 42 MB sharded bf16 folder (a llama of 21M parameters): the job keeps one file
    of exactly its shards' tensors, and the uploading process's peak memory grows by well under the upload's
    size (it sends shards range by range, never the file)."""
    job = job_submit(owner=user, **{**DIGITS_JOB, "dataset_config": {"name": "text", "batch_size": 4}, "model_config": {
        "type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
        "num_attention_heads": 8, "max_position_embeddings": 8,
    }})
    spec = model_spec_from_config(job.model_config)
    folder, weight_map = tmp_path / "shipped", {}
    folder.mkdir()
    names = [f"layers.{i}.{n}" for i in range(spec.num_layers) for n in spec.layer_parameters(i)]
    for shard, start in enumerate(range(0, len(names), 20)):
        file = f"model-{shard:05d}.safetensors"
        tensors = {hf_name(spec, n): torch.full(spec.layer_parameters(int(n.split(".")[1]))[n.split(".", 2)[2]],
                                                 float(i), dtype=torch.bfloat16)
                   for i, n in enumerate(names[start : start + 20], start)}
        save_file(tensors, folder / file)
        weight_map |= dict.fromkeys(tensors, file)
    (folder / SHARDS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hf_config(spec)))
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert size > 40e6

    argv = ["--url", live_server.url, "--token", user_token_get_or_create(user=user), "jobs", "weights", str(job.id),
            str(folder)]
    run = subprocess.run([sys.executable, "-c", _MEASURED_CLI, *argv], capture_output=True, text=True, timeout=300)
    before, after, code = (int(v) for v in run.stdout.split()[-3:])
    assert code == 0, run.stdout + run.stderr
    assert after - before < size / 4, f"the uploader's peak grew by {(after - before) / 1e6:.1f} MB"
    job.refresh_from_db()
    stored = checkpoint_dir / job.initial_weights.name
    with stored.open("rb") as handle:
        layouts = tensor_layouts(handle, stored.stat().st_size)
    assert set(layouts) == set(weight_map) and {dtype for dtype, _ in layouts.values()} == {"BF16"}
    assert safetensors_load(stored.read_bytes())[hf_name(spec, names[-1])][0, 0] == len(names) - 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lm_head__weight": None}, "the weights lack lm_head.weight"),
        ({"extra__weight": torch.zeros(2)}, "extra.weight is no parameter of this model"),
        ({"model__norm__weight": torch.ones(17)}, "model.norm.weight is float32 [17]; the model's is float32 [16]"),
        ({"model__norm__weight": torch.ones(16, dtype=torch.float64)},  # bf16, fp16 widen to it; nothing else
         "model.norm.weight is float64 [16]; the model's is float32 [16] (or bfloat16, float16)"),
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


def test_weights_uploaded_before_layer_digests_get_them_when_migrating(
    api: APIClient, llama_job: Job, checkpoint_dir: Path  # noqa: F811
) -> None:
    data = weights_file(llama_job)
    assert put(api, llama_job, data)["http"] == 200
    llama_job.refresh_from_db()
    kept = llama_job.initial_weights_layer_sha256
    Job.objects.filter(pk=llama_job.pk).update(initial_weights_layer_sha256=[])
    migration = importlib.import_module("controlplane.jobs.migrations.0014_job_initial_weights_layer_sha256")
    migration.digest_uploaded_weights(django_apps, None)
    llama_job.refresh_from_db()
    assert llama_job.initial_weights_layer_sha256 == kept and len(kept) == 4
