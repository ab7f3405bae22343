"""Coordinated checkpoints: saved under the driver lease, pruned, fetched by the agents hosting the
stage, and assembled into the whole model for the job's owner."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from django.db import IntegrityError
from django.utils import timezone
from prometheus_client import REGISTRY
from rest_framework.test import APIClient
from transformers import AutoTokenizer

from arceus.checkpoint import checkpoint_digest, decode_checkpoint, encode_checkpoint, state_chunks
from arceus.cli import main as cli_main
from arceus.contracts.assignment import Assignment, CheckpointRef
from arceus.data.tokenizer import train_bpe
from arceus.model.build import build_layers, named_global_parameters
from arceus.model.registry import model_spec_from_config
from arceus.safetensors_file import CHUNK_BYTES, CheckpointError, StageStateError
from arceus.training.plan import StageStateFile
from controlplane.accounts.services import user_token_get_or_create
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.common.errors import ApplicationError
from controlplane.controller.executor import reconcile_once
from controlplane.controller.transitions import job_rewind
from controlplane.datasets.models import Dataset, dataset_storage
from controlplane.jobs.checkpoints import (
    KEEP_CHECKPOINTS,
    checkpoint_save,
    checkpoint_uploads_open,
    job_model_file,
    stage_checkpoint_for_node,
)
from controlplane.jobs.leases import job_driver_claim
from controlplane.jobs.models import (
    Checkpoint,
    CheckpointUpload,
    Job,
    Stage,
    StageCheckpoint,
    checkpoint_storage,
)
from controlplane.jobs.selectors import job_stage_endpoints
from controlplane.jobs.services import job_cancel
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create, node_token_rotate
from controlplane.settings import checkpoint_storage_settings
from devtools.pipeline import identity_for
from nodeagent.control_plane import ControlPlaneClient
from tests.controlplane.conftest import S3Server
from tests.controlplane.datasets.test_datasets_api import upload as upload_dataset

pytestmark = pytest.mark.django_db

SIZES = [64, 32, 16, 10]  # the conftest's digits job: three stages of one layer each
DRIVER = "driver-a"


@pytest.fixture
def checkpoint_dir(settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Checkpoint files go under tmp_path. Changing settings.STORAGES resets django's storage handler
    (django.test.signals.storages_changed); StageCheckpoint.file resolved its storage when the model was
    imported, so it is pointed at the new one too (the agent endpoint opens files through it)."""
    settings.STORAGES = {
        **settings.STORAGES,
        "checkpoints": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path)},
        },
    }
    storage = checkpoint_storage()
    assert Path(storage.location) == tmp_path
    for model in (StageCheckpoint, CheckpointUpload):
        monkeypatch.setattr(model._meta.get_field("file"), "storage", storage)
    return tmp_path


def files_in(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def agent_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    return client


@pytest.fixture
def agents(user) -> list[tuple[Node, APIClient]]:
    """Three Ready nodes, each with a client holding its node token."""
    made = []
    now = timezone.now()
    for i in range(3):
        node, token = node_create(owner=user, name=f"agent-{i}")
        node_register(
            node=node,
            grpc_address=f"10.0.0.{i + 1}:5005{i}", tls_certificate=identity_for(f"10.0.0.{i + 1}:5005{i}").certificate,
            device_type="cpu",
            device_name="test cpu",
            memory_bytes=2**30,
            flops_fp32=1e9,
            now=now,
        )
        node_heartbeat(node=node, observed=[], now=now)
        made.append((node, agent_client(token)))
    return made


@pytest.fixture
def running_job(agents, queued_job, checkpoint_dir: Path) -> Job:
    """A job placed on the three agents, running, its driver lease held by DRIVER."""
    job = queued_job()
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status="running", restarts=2)
    assert job_driver_claim(job_id=job.id, owner=DRIVER, now=timezone.now()) is not None
    job.refresh_from_db()
    assert Stage.objects.filter(job=job, active=True).count() == 3
    return job


def stage_tensors(index: int, step: int) -> dict[str, torch.Tensor]:
    """Stage `index`'s state after `step`: its values say which stage and step they came from."""
    weight = torch.full((SIZES[index + 1], SIZES[index]), step + index / 10)
    bias = torch.full((SIZES[index + 1],), -(step + index / 10))
    return {
        f"layers.{index}.weight": weight,
        f"layers.{index}.bias": bias,
        f"optimizer.layers.{index}.weight.momentum_buffer": weight * 0.5,
        f"optimizer.layers.{index}.bias.momentum_buffer": bias * 0.5,
    }


def stage_files(step: int) -> list[StageStateFile]:
    return [state_file(i, i, i + 1, encode_checkpoint(stage_tensors(i, step))) for i in range(3)]

def state_file(index: int, layer_start: int, layer_end: int, data: bytes) -> StageStateFile:
    """A stage's state file as the driver hands it to the sink."""
    handle, name = tempfile.mkstemp(suffix=".safetensors")
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    return StageStateFile(index, layer_start, layer_end, Path(name), checkpoint_digest(data), len(data))



def save(job: Job, step: int, *, epoch: int = 1, files: list[StageStateFile] | None = None, **changes: Any):
    kwargs = {"job_id": job.id, "lease_owner": DRIVER, "generation": job.generation, **changes}
    return checkpoint_save(step=step, epoch=epoch, stages=stage_files(step) if files is None else files, **kwargs)


def header_metadata(data: bytes) -> dict[str, str]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])["__metadata__"]


# --- checkpoint_save --------------------------------------------------------------------------------
def test_the_driver_saves_every_stage_and_resets_the_restart_count(running_job: Job, checkpoint_dir: Path) -> None:
    files = stage_files(10)
    checkpoint = save(running_job, 10, epoch=2, files=files)
    assert checkpoint is not None
    assert (checkpoint.job_id, checkpoint.step, checkpoint.epoch, checkpoint.generation) == (
        running_job.id,
        10,
        2,
        running_job.generation,
    )
    rows = list(StageCheckpoint.objects.filter(checkpoint=checkpoint).order_by("stage_index"))
    assert [(r.stage_index, r.layer_start, r.layer_end) for r in rows] == [(0, 0, 1), (1, 1, 2), (2, 2, 3)]
    on_disk = files_in(checkpoint_dir)
    for row, stage in zip(rows, files, strict=True):
        assert row.file.name == f"checkpoints/{running_job.id}/step-00000010/stage-{stage.index}.safetensors"
        data = stage.path.read_bytes()
        assert on_disk[row.file.name] == data
        assert (row.sha256, row.size_bytes) == (checkpoint_digest(data), len(data))
    assert len(on_disk) == 3
    assert Job.objects.get(pk=running_job.pk).restarts == 0  # the job made progress


@pytest.mark.parametrize("case", ["another driver", "an older generation", "a cancelled job", "a lost lease"])
def test_a_save_without_the_lease_is_refused_and_leaves_no_files(
    running_job: Job, checkpoint_dir: Path, case: str
) -> None:
    changes: dict[str, Any] = {}
    if case == "another driver":
        changes["lease_owner"] = "driver-b"
    elif case == "an older generation":
        changes["generation"] = running_job.generation - 1
    elif case == "a cancelled job":
        job_cancel(job=running_job)
    else:  # the lease expired and another driver took the job over
        later = timezone.now() + timedelta(hours=1)
        assert job_driver_claim(job_id=running_job.id, owner="driver-b", now=later) is not None
    assert save(running_job, 10, **changes) is None
    assert not Checkpoint.objects.exists() and not StageCheckpoint.objects.exists()
    assert files_in(checkpoint_dir) == {}
    assert Job.objects.get(pk=running_job.pk).restarts == 2


def test_a_save_that_fails_midway_removes_its_files_and_raises(running_job: Job, checkpoint_dir: Path) -> None:
    files = stage_files(10)
    twice = [files[0], files[1], replace(files[2], index=1)]  # stage 1 twice: a database constraint
    with pytest.raises(IntegrityError):
        save(running_job, 10, files=twice)
    assert files_in(checkpoint_dir) == {}
    assert not Checkpoint.objects.exists()
    assert Job.objects.get(pk=running_job.pk).restarts == 2


def saved_steps(job: Job) -> list[int]:
    return list(Checkpoint.objects.filter(job=job).order_by("step").values_list("step", flat=True))


def test_older_checkpoints_are_pruned_with_their_files(
    running_job: Job, checkpoint_dir: Path, django_capture_on_commit_callbacks
) -> None:
    assert KEEP_CHECKPOINTS == 2
    for step in (10, 20, 30, 40):
        with django_capture_on_commit_callbacks(execute=True):
            assert save(running_job, step) is not None
    assert saved_steps(running_job) == [30, 40]
    kept = set(StageCheckpoint.objects.values_list("file", flat=True))
    assert set(files_in(checkpoint_dir)) == kept and len(kept) == 6


def test_the_checkpoint_the_stages_resume_from_is_kept(
    running_job: Job, checkpoint_dir: Path, django_capture_on_commit_callbacks
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        resume = save(running_job, 10)
    Job.objects.filter(pk=running_job.pk).update(resume_checkpoint=resume)
    for step in (20, 30, 40, 50):
        with django_capture_on_commit_callbacks(execute=True):
            save(running_job, step)
    assert saved_steps(running_job) == [10, 40, 50]
    assert len(files_in(checkpoint_dir)) == 9
    assert Job.objects.get(pk=running_job.pk).resume_checkpoint_id == resume.id


def test_saving_a_step_again_replaces_it(
    running_job: Job, checkpoint_dir: Path, django_capture_on_commit_callbacks
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        save(running_job, 10)
        first = save(running_job, 20)
    replay = [state_file(i, i, i + 1, encode_checkpoint(stage_tensors(i, 99))) for i in range(3)]
    with django_capture_on_commit_callbacks(execute=True):
        second = save(running_job, 20, files=replay)
    assert second.pk != first.pk and not Checkpoint.objects.filter(pk=first.pk).exists()
    assert saved_steps(running_job) == [10, 20]  # the replaced one does not count against the older one
    rows = StageCheckpoint.objects.filter(checkpoint=second).order_by("stage_index")
    assert [r.sha256 for r in rows] == [f.sha256 for f in replay]
    on_disk = files_in(checkpoint_dir)
    assert len(on_disk) == 6  # step 10's and the new step 20's: the replaced files are gone
    assert [on_disk[r.file.name] for r in rows] == [f.path.read_bytes() for f in replay]


def test_replacing_the_checkpoint_being_resumed_from_keeps_resuming_from_the_new_one(running_job: Job) -> None:
    # A driver resumed from the final checkpoint saves that same step again.
    first = save(running_job, 20)
    Job.objects.filter(pk=running_job.pk).update(resume_checkpoint=first)
    second = save(running_job, 20)
    assert Job.objects.get(pk=running_job.pk).resume_checkpoint_id == second.pk


# --- stage_checkpoint_for_node ------------------------------------------------------------------------
def test_only_the_node_hosting_the_stage_gets_its_checkpoint(running_job: Job, agents) -> None:
    checkpoint = save(running_job, 10)
    host = dict(Stage.objects.filter(job=running_job).values_list("index", "node_id"))
    sc = StageCheckpoint.objects.get(checkpoint=checkpoint, stage_index=1)
    assert stage_checkpoint_for_node(node_id=host[1], stage_checkpoint_id=str(sc.id)) == sc
    for node_id in (host[0], host[2]):
        with pytest.raises(ApplicationError) as info:
            stage_checkpoint_for_node(node_id=node_id, stage_checkpoint_id=str(sc.id))
        assert info.value.status == 404
        assert info.value.message == f"checkpoint {sc.id} not found"
    for garbage in ("not-a-uuid", "00000000-0000-0000-0000-000000000000"):
        with pytest.raises(ApplicationError, match="not found"):
            stage_checkpoint_for_node(node_id=host[1], stage_checkpoint_id=garbage)
    # Once the stage is no longer active on the node (the job finished or it moved), it is not its any more.
    Stage.objects.filter(job=running_job, index=1).update(active=False)
    with pytest.raises(ApplicationError, match="not found"):
        stage_checkpoint_for_node(node_id=host[1], stage_checkpoint_id=str(sc.id))


def test_a_node_hosting_the_same_index_of_another_job_gets_nothing(running_job: Job, queued_job, user) -> None:
    sc = StageCheckpoint.objects.get(checkpoint=save(running_job, 10), stage_index=0)
    other = queued_job()
    node, _ = node_create(owner=user, name="elsewhere")
    Stage.objects.create(job=other, index=0, layer_start=0, layer_end=1, node=node, generation=other.generation)
    with pytest.raises(ApplicationError, match="not found"):
        stage_checkpoint_for_node(node_id=node.id, stage_checkpoint_id=str(sc.id))


# --- job_model_file -----------------------------------------------------------------------------------
def test_the_model_file_merges_the_newest_checkpoints_weights(running_job: Job) -> None:
    save(running_job, 10)
    newest = save(running_job, 20, epoch=3)
    model = job_model_file(job=running_job)
    data, checkpoint = b"".join(model.chunks), model.checkpoint
    assert checkpoint == newest and len(data) == model.size_bytes
    tensors = decode_checkpoint(data)
    expected = {k: v for i in range(3) for k, v in stage_tensors(i, 20).items() if not k.startswith("optimizer.")}
    assert set(tensors) == set(expected)  # all six weights, no optimizer entries
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    metadata = header_metadata(data)
    assert metadata == {
        "job_id": str(running_job.id),
        "step": "20",
        "epoch": "3",
        "model_config": json.dumps(running_job.model_config, sort_keys=True),
    }
    assert json.loads(metadata["model_config"]) == {"type": "mlp", "layer_sizes": SIZES}


def test_the_model_file_needs_a_checkpoint(running_job: Job) -> None:
    with pytest.raises(ApplicationError) as info:
        job_model_file(job=running_job)
    assert info.value.status == 409
    assert "has no checkpoint yet" in info.value.message


def test_a_damaged_checkpoint_file_is_not_served_as_the_model(running_job: Job, checkpoint_dir: Path) -> None:
    sc = StageCheckpoint.objects.get(checkpoint=save(running_job, 10), stage_index=2)
    path = checkpoint_dir / sc.file.name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt or replaced"):
        job_model_file(job=running_job)


# --- the agent's checkpoint endpoint and the assignment naming it --------------------------------------
def download(client: APIClient, url: str) -> Any:
    response = client.get(url)
    if response.status_code == 200:
        # Consuming the stream closes the file (the test client then sends request_finished itself).
        response.body = b"".join(response.streaming_content)
    return response


def bytes_read() -> float:
    return REGISTRY.get_sample_value("arceus_checkpoint_bytes_read_total") or 0.0


def test_the_hosting_agent_downloads_its_stage_checkpoint(running_job: Job, agents) -> None:
    checkpoint = save(running_job, 10)
    by_node = {node.id: client for node, client in agents}
    host = dict(Stage.objects.filter(job=running_job).values_list("index", "node_id"))
    files = stage_files(10)
    for index in range(3):
        sc = StageCheckpoint.objects.get(checkpoint=checkpoint, stage_index=index)
        read_before = bytes_read()
        response = download(by_node[host[index]], f"/api/agent/checkpoints/{sc.id}")
        assert response.status_code == 200
        # every byte served was read from the checkpoint storage, and counted
        assert bytes_read() - read_before == files[index].path.stat().st_size
        assert response["Content-Type"] == "application/octet-stream"
        assert response["X-Checkpoint-SHA256"] == sc.sha256 == files[index].sha256
        assert response.body == files[index].path.read_bytes()
        other = by_node[host[(index + 1) % 3]]
        refused = download(other, f"/api/agent/checkpoints/{sc.id}")
        assert refused.status_code == 404
        assert refused.json()["detail"] == f"checkpoint {sc.id} not found"


def test_the_checkpoint_endpoint_needs_a_node_token(running_job: Job, api: APIClient) -> None:
    sc = StageCheckpoint.objects.filter(checkpoint=save(running_job, 10)).first()
    url = f"/api/agent/checkpoints/{sc.id}"
    assert APIClient().get(url).status_code == 401
    assert api.get(url).status_code == 401  # the job owner's user token is not a node token
    assert agent_client("wrong-token").get(url).status_code == 401


def test_the_assignment_of_a_rewound_job_names_its_checkpoint(running_job: Job, agents) -> None:
    with_checkpoint = save(running_job, 10)
    assert job_rewind(
        job_id=running_job.id, generation=running_job.generation, reason="Test", message="rewound", now=timezone.now()
    )
    running_job.refresh_from_db()
    assert running_job.resume_checkpoint == with_checkpoint
    files = stage_files(10)
    for _, client in agents:
        [assignment] = client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]
        index = assignment["stage_index"]
        sc = StageCheckpoint.objects.get(checkpoint=with_checkpoint, stage_index=index)
        assert assignment["generation"] == running_job.generation
        assert assignment["checkpoint"] == {
            "step": 10,
            "url": f"/api/agent/checkpoints/{sc.id}",
            "sha256": files[index].sha256,
        }
        ref = Assignment.from_json(assignment).checkpoint  # the agent's own parser accepts it
        # ... and what the url serves is what the hash names.
        state = decode_checkpoint(download(client, ref.url).body, sha256=ref.sha256)
        assert torch.equal(state[f"layers.{index}.weight"], stage_tensors(index, 10)[f"layers.{index}.weight"])


def test_a_job_without_a_resume_checkpoint_assigns_none(running_job: Job, agents) -> None:
    save(running_job, 10)  # saved, but the stages still run from their initial weights
    for _, client in agents:
        [assignment] = client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]
        assert assignment["checkpoint"] is None


# --- the owner's model endpoint --------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["model", "model.safetensors"])
def test_the_owner_downloads_the_model(running_job: Job, api: APIClient, suffix: str) -> None:
    save(running_job, 10)
    response = api.get(f"/api/jobs/{running_job.id}/{suffix}")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/octet-stream"
    assert response["Content-Disposition"] == f'attachment; filename="{running_job.id}-step-10.safetensors"'
    content = b"".join(response.streaming_content)
    assert int(response["Content-Length"]) == len(content)
    tensors = decode_checkpoint(content)
    assert sorted(tensors) == [f"layers.{i}.{p}" for i in range(3) for p in ("bias", "weight")]
    assert header_metadata(content)["step"] == "10"


@pytest.mark.django_db(transaction=True)
def test_the_cli_streams_the_model_into_a_file(live_server, running_job: Job, user, tmp_path: Path) -> None:
    save(running_job, 10)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    output = downloads / "model.safetensors"
    argv = ["--url", live_server.url, "--token", user_token_get_or_create(user=user)]
    assert cli_main([*argv, "jobs", "model", str(running_job.id), "-o", str(output)]) == 0
    names = [f"layers.{i}.{p}" for i in range(3) for p in ("bias", "weight")]
    assert sorted(decode_checkpoint(output.read_bytes())) == names
    assert cli_main([*argv, "jobs", "model", "00000000-0000-0000-0000-000000000000", "-o", str(downloads / "x")]) != 0
    assert sorted(p.name for p in downloads.iterdir()) == ["model.safetensors"]  # a failed download leaves nothing


@pytest.mark.parametrize(
    ("model_format", "message"),
    [
        ("hf", "a model of type 'mlp' has no Hugging Face format (only transformer, llama)"),
        ("pickle", "must be one of safetensors, hf"),
    ],
)
def test_a_model_format_the_job_lacks_is_a_400_naming_format(
    running_job: Job, api: APIClient, model_format: str, message: str
) -> None:
    save(running_job, 10)
    response = api.get(f"/api/jobs/{running_job.id}/model", {"format": model_format})
    assert response.status_code == 400
    assert message in response.json()["errors"]["format"][0]


def test_a_llama_with_an_uploaded_tokenizer_downloads_as_a_folder_transformers_loads_whole(
    agents, queued_job, checkpoint_dir: Path, api: APIClient, settings, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    """`?format=hf` of a job whose text is tokenized by an uploaded tokenizer.json: the folder holds it beside the
    config and weights, and `AutoTokenizer.from_pretrained` reads it as the job tokenized its text."""
    settings.STORAGES = {
        **settings.STORAGES,
        "datasets": {"BACKEND": "django.core.files.storage.FileSystemStorage",
                     "OPTIONS": {"location": str(checkpoint_dir / "datasets")}},
    }
    monkeypatch.setattr(Dataset._meta.get_field("file"), "storage", dataset_storage())
    text = "some words to learn merges from, " * 300
    tokenizer = train_bpe(text, 300)
    corpus = upload_dataset(api, text.encode(), "text", piece=1 << 20)
    uploaded = upload_dataset(api, tokenizer.to_json().encode(), "tokenizer", piece=1 << 20)
    job = queued_job(
        model_config={"type": "llama", "vocab": "bpe", "hidden_size": 16, "intermediate_size": 24,
                      "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 8},
        dataset_config={"dataset_id": corpus["id"], "tokenizer_id": uploaded["id"], "batch_size": 4},
    )
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status="running")
    assert job_driver_claim(job_id=job.id, owner=DRIVER, now=timezone.now()) is not None
    job.refresh_from_db()
    spec = model_spec_from_config(job.model_config)
    stages = Stage.objects.filter(job=job, active=True).order_by("index")
    save(job, 5, files=[
        state_file(s.index, s.layer_start, s.layer_end, encode_checkpoint(
            {n: p.detach() for n, p in named_global_parameters(build_layers(spec, s.layer_start, s.layer_end, 3))}
        ))
        for s in stages
    ])

    response = api.get(f"/api/jobs/{job.id}/model", {"format": "hf"})
    assert response.status_code == 200
    folder = checkpoint_dir / "folder"
    with tarfile.open(fileobj=io.BytesIO(b"".join(response.streaming_content)), mode="r|") as tar:
        tar.extractall(folder, filter="data")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    theirs = AutoTokenizer.from_pretrained(folder)
    assert theirs(text[:40], add_special_tokens=False)["input_ids"] == tokenizer.encode(text[:40])


def test_the_model_endpoint_without_a_checkpoint_is_a_409(running_job: Job, api: APIClient) -> None:
    response = api.get(f"/api/jobs/{running_job.id}/model")
    assert response.status_code == 409
    assert response.json()["detail"] == (
        f"job {running_job.id} has no checkpoint yet; the model is available once training has saved one"
    )


def test_another_users_model_is_a_404(running_job: Job, other_api: APIClient) -> None:
    save(running_job, 10)
    response = other_api.get(f"/api/jobs/{running_job.id}/model")
    assert response.status_code == 404
    assert response.json()["detail"] == f"job {running_job.id} not found"
    assert APIClient().get(f"/api/jobs/{running_job.id}/model").status_code == 401


# --- agents upload their stage's state themselves ------------------------------------------------------
def open_uploads(job: Job, step: int, **changes: Any) -> dict[int, CheckpointUpload] | None:
    kwargs = {"job_id": job.id, "lease_owner": DRIVER, "generation": job.generation, "step": step, **changes}
    return checkpoint_uploads_open(stages=job_stage_endpoints(job=job), **kwargs)


def client_of(agents, node_id: Any) -> APIClient:
    return next(c for n, c in agents if str(n.pk) == str(node_id))


def put(client: APIClient, upload: CheckpointUpload, data: bytes, **extra: Any) -> Any:
    return client.put(
        f"/api/agent/checkpoint-uploads/{upload.pk}", data=data, content_type="application/octet-stream", **extra
    )


def upload_all(job: Job, agents, step: int) -> list[StageStateFile]:
    """Every stage's agent uploads its state; what each agent then reports to the driver."""
    uploads = open_uploads(job, step)
    assert uploads is not None
    reported = []
    for index, upload in sorted(uploads.items()):
        data = encode_checkpoint(stage_tensors(index, step))
        response = put(client_of(agents, upload.node_id), upload, data)
        assert response.status_code == 201, response.content
        assert response.json() == {"sha256": checkpoint_digest(data), "size_bytes": len(data)}
        reported.append(
            StageStateFile(index, index, index + 1, None, checkpoint_digest(data), len(data), upload_id=str(upload.pk))
        )
    return reported


def test_a_checkpoint_takes_over_the_files_its_agents_uploaded(
    running_job: Job, agents, checkpoint_dir: Path, settings
) -> None:
    settings.ARCEUS_MAX_REQUEST_BYTES = 64  # the JSON API's bound does not apply to uploads
    checkpoint = save(running_job, 10, files=upload_all(running_job, agents, 10))
    assert checkpoint is not None
    on_disk = files_in(checkpoint_dir)
    for sc in checkpoint.stages.order_by("stage_index"):
        stored = decode_checkpoint(on_disk[sc.file.name], sha256=sc.sha256)
        torch.testing.assert_close(stored, stage_tensors(sc.stage_index, 10))
    assert len(on_disk) == 3 and not CheckpointUpload.objects.exists()  # the files moved to the checkpoint


def test_an_upload_is_taken_only_from_its_node_once_and_whole(running_job: Job, agents, checkpoint_dir: Path) -> None:
    uploads = open_uploads(running_job, 10)
    upload = uploads[0]
    owner, stranger = client_of(agents, upload.node_id), client_of(agents, uploads[1].node_id)
    data = encode_checkpoint(stage_tensors(0, 10))
    assert put(stranger, upload, data).status_code == 404  # another node's upload does not exist for it
    assert put(APIClient(), upload, data).status_code == 401
    not_safetensors = put(owner, upload, b"\xff" * 64)
    assert not_safetensors.status_code == 400 and "not a valid safetensors" in not_safetensors.json()["detail"]
    assert files_in(checkpoint_dir) == {}  # nothing refused is kept
    assert put(owner, upload, data).status_code == 201
    again = put(owner, upload, data)
    assert again.status_code == 409 and "already received" in again.json()["detail"]


def tampered(case: str) -> dict[str, torch.Tensor]:
    """Stage 1's state (layer 1: 32 -> 16, SGD with momentum) as a malicious agent might upload it."""
    tensors = stage_tensors(1, 10)
    if case == "a wrong shape":
        tensors["layers.1.weight"] = torch.zeros(16, 64)
    elif case == "an extra tensor":
        tensors["filler"] = torch.zeros(4096)
    elif case == "another stage's weights":
        tensors = stage_tensors(0, 10)
    elif case == "a missing tensor":
        del tensors["layers.1.bias"]
    else:  # an optimizer entry SGD never keeps
        tensors["optimizer.layers.1.weight.exp_avg"] = torch.zeros(16, 32)
    return tensors


@pytest.mark.parametrize(
    ("case", "detail"),
    [
        ("a wrong shape", "stage 1: layers.1.weight: expected float32 [16, 32], got float32 [16, 64]"),
        ("an extra tensor", "stage 1: unexpected tensor filler: the stage holds layers [1, 2)"),
        ("another stage's weights", "stage 1: unexpected tensor layers.0.bias: the stage holds layers [1, 2)"),
        ("a missing tensor", "stage 1: missing tensor layers.1.bias: expected float32 [16] "
                             "(the stage holds layers [1, 2))"),
        ("a foreign optimizer entry", "stage 1: unexpected tensor optimizer.layers.1.weight.exp_avg: a sgd-momentum "
                                      "optimizer keeps momentum_buffer"),
    ],
)
def test_an_upload_that_is_not_exactly_the_stages_state_is_refused_and_not_kept(
    running_job: Job, agents, checkpoint_dir: Path, case: str, detail: str
) -> None:
    upload = open_uploads(running_job, 10)[1]
    owner = client_of(agents, upload.node_id)
    refused = put(owner, upload, encode_checkpoint(tampered(case)))
    assert refused.status_code == 400 and refused.json()["detail"] == f"body: {detail}"
    assert files_in(checkpoint_dir) == {}  # nothing refused is kept
    upload.refresh_from_db()
    assert not upload.file and not upload.sha256  # still open: the honest state is taken
    assert put(owner, upload, encode_checkpoint(stage_tensors(1, 10))).status_code == 201


def test_a_file_with_more_bytes_than_its_tensors_is_refused(running_job: Job, agents, checkpoint_dir: Path) -> None:
    upload = open_uploads(running_job, 10)[1]
    padded = encode_checkpoint(stage_tensors(1, 10)) + bytes(1 << 20)  # small tensors declared, a MiB carried
    refused = put(client_of(agents, upload.node_id), upload, padded)
    assert refused.status_code == 400
    assert "its tensors hold 4224 bytes of data, but the file carries 1052800" in refused.json()["detail"]
    assert files_in(checkpoint_dir) == {}


def test_a_streamed_stage_file_that_is_not_the_stages_state_fails_the_checkpoint(
    running_job: Job, checkpoint_dir: Path
) -> None:
    files = stage_files(10)
    files[1] = state_file(1, 1, 2, encode_checkpoint(tampered("another stage's weights")))
    with pytest.raises(StageStateError, match=r"stage 1: unexpected tensor layers.0.bias") as refused:
        save(running_job, 10, files=files)
    assert refused.value.stage_index == 1
    assert files_in(checkpoint_dir) == {} and not Checkpoint.objects.exists()


def test_an_upload_reported_for_other_layers_fails_the_checkpoint(running_job: Job, agents) -> None:
    reported = upload_all(running_job, agents, 10)
    reported[1] = replace(reported[1], layer_end=3)
    with pytest.raises(StageStateError, match="stage 1: no upload"):
        save(running_job, 10, files=reported)


def test_an_upload_that_differs_from_what_the_agent_sent_fails_the_checkpoint(
    running_job: Job, agents, checkpoint_dir: Path
) -> None:
    reported = upload_all(running_job, agents, 10)
    reported[1] = replace(reported[1], sha256="0" * 64)
    with pytest.raises(CheckpointError, match="stage 1: the control plane received"):
        save(running_job, 10, files=reported)
    assert not Checkpoint.objects.exists()


def test_a_checkpoint_needs_every_upload_received(running_job: Job, agents) -> None:
    uploads = open_uploads(running_job, 10)
    reported = [StageStateFile(i, i, i + 1, None, "0" * 64, 1, upload_id=str(u.pk)) for i, u in uploads.items()]
    with pytest.raises(CheckpointError, match="never received"):
        save(running_job, 10, files=reported)
    with pytest.raises(CheckpointError, match="no upload"):
        save(running_job, 11, files=reported)  # opened for step 10


def test_uploads_are_opened_only_under_the_lease_and_replace_an_unfinished_checkpoints(
    running_job: Job, agents, checkpoint_dir: Path, django_capture_on_commit_callbacks
) -> None:
    assert open_uploads(running_job, 10, lease_owner="driver-b") is None
    upload_all(running_job, agents, 10)  # the driver died before saving the checkpoint
    assert len(files_in(checkpoint_dir)) == 3
    with django_capture_on_commit_callbacks(execute=True):
        assert open_uploads(running_job, 20) is not None
    assert files_in(checkpoint_dir) == {}
    assert CheckpointUpload.objects.filter(step=10).count() == 0


# --- an S3-compatible bucket instead of the filesystem -----------------------------------------------
@pytest.fixture
def s3_bucket(s3_server: S3Server, settings, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The checkpoint storage configured for a real S3-API server exactly as an operator's environment would."""
    settings.STORAGES = {**settings.STORAGES, "checkpoints": checkpoint_storage_settings(s3_server.env)}
    for model in (StageCheckpoint, CheckpointUpload):
        monkeypatch.setattr(model._meta.get_field("file"), "storage", checkpoint_storage())
    return s3_server.client


def test_checkpoints_live_in_an_s3_bucket_when_one_is_configured(running_job: Job, agents, s3_bucket) -> None:
    assert type(checkpoint_storage()).__name__ == "S3Storage"
    checkpoint = save(running_job, 10)
    keys = sorted(o["Key"] for o in s3_bucket.list_objects_v2(Bucket="arceus-checkpoints")["Contents"])
    assert keys == sorted(sc.file.name for sc in checkpoint.stages.all()) and len(keys) == 3

    # The hosting agent downloads its stage from the bucket through the control plane, hash intact.
    sc = checkpoint.stages.get(stage_index=0)
    node = Stage.objects.get(job=running_job, index=0).node
    client = next(c for n, c in agents if n.pk == node.pk)
    read_before = bytes_read()
    response = client.get(f"/api/agent/checkpoints/{sc.id}")
    assert response.status_code == 307  # to the bucket itself: the control plane signs, it does not carry
    assert bytes_read() - read_before == sc.size_bytes  # read from storage all the same: counted as it is signed
    data = requests.get(response["Location"], timeout=10).content
    assert checkpoint_digest(data) == sc.sha256 == response["X-Checkpoint-SHA256"]
    torch.testing.assert_close(decode_checkpoint(data)["layers.0.weight"], stage_tensors(0, 10)["layers.0.weight"])
    model = b"".join(job_model_file(job=running_job).chunks)
    assert sorted(decode_checkpoint(model)) == [f"layers.{i}.{p}" for i in range(3) for p in ("bias", "weight")]


def test_agents_upload_their_state_into_the_s3_bucket(running_job: Job, agents, s3_bucket) -> None:
    checkpoint = save(running_job, 10, files=upload_all(running_job, agents, 10))
    listed = s3_bucket.list_objects_v2(Bucket="arceus-checkpoints", Prefix=f"checkpoints/{running_job.id}/")
    keys = sorted(o["Key"] for o in listed["Contents"])
    assert keys == sorted(sc.file.name for sc in checkpoint.stages.all()) and len(keys) == 3
    model = b"".join(job_model_file(job=running_job).chunks)
    torch.testing.assert_close(decode_checkpoint(model)["layers.2.weight"], stage_tensors(2, 10)["layers.2.weight"])


def multipart_uploads(bucket: Any) -> list[str]:
    return [u["Key"] for u in bucket.list_multipart_uploads(Bucket="arceus-checkpoints").get("Uploads", [])]


def start_parts(client: APIClient, upload: CheckpointUpload, size: int) -> Any:
    return client.post(f"/api/agent/checkpoint-uploads/{upload.pk}/parts", {"size_bytes": size}, format="json")


def complete_parts(client: APIClient, upload: CheckpointUpload, **body: Any) -> Any:
    return client.post(f"/api/agent/checkpoint-uploads/{upload.pk}/parts/complete", body, format="json")


def test_an_agent_sends_its_parts_to_the_bucket_and_the_control_plane_checks_what_arrived(
    running_job: Job, agents, s3_bucket
) -> None:
    uploads = open_uploads(running_job, 10)
    upload = uploads[1]
    owner, stranger = client_of(agents, upload.node_id), client_of(agents, uploads[0].node_id)
    data = encode_checkpoint(stage_tensors(1, 10))
    assert start_parts(stranger, upload, len(data)).status_code == 404  # nobody touches what is not theirs
    assert start_parts(owner, upload, 0).status_code == 400
    started = start_parts(owner, upload, len(data)).json()
    assert len(started["part_urls"]) == 1 and requests.put(started["part_urls"][0], data=data, timeout=10).ok
    digest = checkpoint_digest(data)
    complete = {"multipart_id": started["multipart_id"], "sha256": digest}
    assert complete_parts(stranger, upload, **complete, size_bytes=len(data)).status_code == 404
    refused = complete_parts(owner, upload, **complete, size_bytes=len(data) + 1)  # not what the bucket holds
    assert refused.status_code == 400
    assert f"{len(data)} bytes arrived of the {len(data) + 1}" in refused.json()["detail"]
    assert "Contents" not in s3_bucket.list_objects_v2(Bucket="arceus-checkpoints")  # nothing refused is kept

    bad = encode_checkpoint(tampered("a wrong shape"))
    started = start_parts(owner, upload, len(bad)).json()
    requests.put(started["part_urls"][0], data=bad, timeout=10)
    refused = complete_parts(owner, upload, multipart_id=started["multipart_id"], sha256=digest, size_bytes=len(bad))
    assert refused.status_code == 400 and "layers.1.weight: expected float32 [16, 32]" in refused.json()["detail"]

    started = start_parts(owner, upload, len(data)).json()
    requests.put(started["part_urls"][0], data=data, timeout=10)
    another = start_parts(client_of(agents, uploads[0].node_id), uploads[0], 64).json()["multipart_id"]
    wrong = complete_parts(owner, upload, multipart_id=another, sha256=digest, size_bytes=len(data))  # not its own
    assert wrong.status_code == 409 and f"no multipart upload {another} is open" in wrong.json()["detail"]
    done = complete_parts(owner, upload, multipart_id=started["multipart_id"], sha256=digest, size_bytes=len(data))
    assert done.status_code == 201 and done.json() == {"sha256": digest, "size_bytes": len(data)}
    assert "already received" in complete_parts(owner, upload, **complete, size_bytes=len(data)).json()["detail"]
    owner.delete(f"/api/agent/checkpoint-uploads/{upload.pk}/parts?multipart_id={another}")  # not its upload's
    assert len(multipart_uploads(s3_bucket)) == 1
    stranger.delete(f"/api/agent/checkpoint-uploads/{uploads[0].pk}/parts?multipart_id={another}")
    assert multipart_uploads(s3_bucket) == []


def test_a_failed_direct_upload_is_aborted_and_a_dead_agents_is_aborted_by_the_next_checkpoint(
    running_job: Job, agents, s3_bucket, django_capture_on_commit_callbacks
) -> None:
    uploads = open_uploads(running_job, 10)
    owner = client_of(agents, uploads[0].node_id)
    started = start_parts(owner, uploads[0], 1000).json()
    assert owner.delete(
        f"/api/agent/checkpoint-uploads/{uploads[0].pk}/parts?multipart_id={started['multipart_id']}"
    ).status_code == 204
    start_parts(owner, uploads[0], 1000)  # its agent dies before it completes
    assert len(multipart_uploads(s3_bucket)) == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert open_uploads(running_job, 20) is not None
    assert multipart_uploads(s3_bucket) == []


def test_an_upload_left_open_is_resumed_only_by_its_own_agent_and_withdrawn_with_its_job(
    running_job: Job, agents, s3_bucket, other_user, settings, django_capture_on_commit_callbacks
) -> None:
    settings.ARCEUS_CHECKPOINT_PART_BYTES = 5 << 20
    uploads = open_uploads(running_job, 10)
    upload = uploads[1]
    owner = client_of(agents, upload.node_id)
    node, token = node_create(owner=other_user, name="another-tenants")  # an agent of another tenant, and of no job
    node_register(node=node, grpc_address="10.0.9.9:50059", tls_certificate=identity_for("10.0.9.9:50059").certificate,
                  device_type="cpu", device_name="test cpu", memory_bytes=2**30, flops_fp32=1e9, now=timezone.now())
    strangers = [agent_client(token), client_of(agents, uploads[0].node_id)]  # and one of another stage
    size = (5 << 20) + 10
    started = start_parts(owner, upload, size)
    assert started.status_code == 201 and len(started.json()["part_urls"]) == 2
    multipart_id = started.json()["multipart_id"]
    assert requests.put(started.json()["part_urls"][0], data=b"x" * (5 << 20), timeout=10).ok
    for stranger in strangers:  # neither lists the parts, completes, nor aborts the upload
        listed = start_parts(stranger, upload, size)
        assert listed.status_code == 404 and multipart_id not in listed.text and "etag" not in listed.text
        done = complete_parts(stranger, upload, multipart_id=multipart_id, sha256="ab" * 32, size_bytes=size)
        assert done.status_code == 404
        aborted = stranger.delete(f"/api/agent/checkpoint-uploads/{upload.pk}/parts?multipart_id={multipart_id}")
        assert aborted.status_code == 404
    assert len(multipart_uploads(s3_bucket)) == 1
    lacking = complete_parts(owner, upload, multipart_id=multipart_id, sha256="ab" * 32, size_bytes=size)
    assert lacking.status_code == 409 and "lacks parts 2 of 2" in lacking.json()["detail"]

    resumed = start_parts(owner, upload, size)  # its own agent, back: the same upload, part 1 held
    assert resumed.status_code == 200 and resumed.json()["multipart_id"] == multipart_id
    assert [(p["number"], p["size_bytes"]) for p in resumed.json()["stored_parts"]] == [(1, 5 << 20)]
    # The driver tries the checkpoint again (a replica lost): the stages' open uploads are kept, to be resumed.
    again = open_uploads(running_job, 10)
    assert again is not None and {i: u.pk for i, u in again.items()} == {i: u.pk for i, u in uploads.items()}
    assert len(multipart_uploads(s3_bucket)) == 1
    with django_capture_on_commit_callbacks(execute=True):  # the job ends: what was left open is aborted
        job_cancel(job=running_job, now=timezone.now())
    assert multipart_uploads(s3_bucket) == [] and not CheckpointUpload.objects.filter(job=running_job).exists()


def stage_state(index: int, rows: int, cols: int, value: float) -> dict[str, torch.Tensor]:
    """An MLP stage's state with SGD momentum: a rows x cols layer, every value fixed."""
    weight, bias = torch.full((rows, cols), value), torch.full((rows,), -value)
    return {f"layers.{index}.weight": weight, f"layers.{index}.bias": bias,
            f"optimizer.layers.{index}.weight.momentum_buffer": weight.clone(),
            f"optimizer.layers.{index}.bias.momentum_buffer": bias.clone()}


class CountingRelay:
    """A TCP relay on loopback in front of a server: every byte either way passes it and is counted (`bytes`; `up`
    toward the server, `down` back). `cut_up_after` / `cut_down_after`: the next connection to carry more than that
    many bytes that way is cut there (once), as a network failure would."""

    def __init__(self, url: str) -> None:
        self._target = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.up = self.down = 0
        self.cut_up_after: int | None = None
        self.cut_down_after: int | None = None
        self.cuts = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def bytes(self) -> int:
        return self.up + self.down

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            for source, sink, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(source, sink, way), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, way: str) -> None:
        carried = 0
        try:
            while data := source.recv(1 << 16):
                with self._lock:
                    limit = getattr(self, f"cut_{way}_after")
                    if limit is not None and carried + len(data) > limit:
                        data = data[: limit - carried]
                        setattr(self, f"cut_{way}_after", None)
                        self.cuts += 1
                        cut = True
                    else:
                        cut = False
                    carried += len(data)
                    setattr(self, way, getattr(self, way) + len(data))
                sink.sendall(data)
                if cut:
                    break
        except OSError:
            pass
        finally:
            for end in (sink, source):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def close(self) -> None:
        self._listener.close()


@pytest.mark.django_db(transaction=True)
def test_a_stage_over_256_mib_checkpoints_through_the_bucket_with_under_1_mib_through_the_web_server(
    live_server, user, agents, queued_job, s3_bucket
) -> None:
    width = 600_000  # stage 0: a 64 -> 600,000 layer, its weights and SGD momentum: 312 MB
    job = queued_job(model_config={"type": "mlp", "layer_sizes": [64, width, 1, 10]})
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status="running")
    assert job_driver_claim(job_id=job.id, owner=DRIVER, now=timezone.now()) is not None
    job.refresh_from_db()
    uploads = open_uploads(job, 10)
    upload = uploads[0]
    token = node_token_rotate(node=Node.objects.get(pk=upload.node_id), user=user)

    state = stage_state(0, width, 64, 0.25)
    size = state_chunks(state)[0]
    assert size > 256 << 20
    others = [state_file(i, i, i + 1, encode_checkpoint(stage_state(i, *shape, 0.0)))
              for i, shape in ((1, (1, width)), (2, (10, 1)))]

    relay = CountingRelay(live_server.url)  # the agent reaches the web server only through it
    try:
        agent = ControlPlaneClient(relay.url, token, timeout=60)
        path = f"/api/agent/checkpoint-uploads/{upload.pk}"
        sha256 = agent.upload_state(path, size, lambda: state_chunks(state)[1], 300)
        reported = StageStateFile(0, 0, 1, None, sha256, size, upload_id=str(upload.pk))
        checkpoint = save(job, 10, files=[reported, *others])
        sc = checkpoint.stages.get(stage_index=0)
        loaded = agent.fetch_checkpoint(CheckpointRef(10, f"/api/agent/checkpoints/{sc.pk}", sc.sha256))
    finally:
        relay.close()
    assert relay.bytes < 1 << 20, f"{relay.bytes} bytes went through the web server"
    assert (sc.size_bytes, sc.sha256) == (size, sha256)
    torch.testing.assert_close(loaded["layers.0.bias"], state["layers.0.bias"])
    assert multipart_uploads(s3_bucket) == []


# An agent that uploads stage 0's state of a 64 -> width layer with its SGD momentum (every value fixed, so this test
# makes the same bytes) in parts, and stops for good after `stop_after` bytes: the test SIGKILLs it there.
KILLED_AGENT = """
import sys, time, torch
from arceus.checkpoint import state_chunks
from nodeagent.control_plane import ControlPlaneClient
url, token, path, width, stop_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
weight, bias = torch.full((width, 64), 0.25), torch.full((width,), -0.25)
state = {"layers.0.weight": weight, "layers.0.bias": bias, "optimizer.layers.0.weight.momentum_buffer": weight,
         "optimizer.layers.0.bias.momentum_buffer": bias}
def chunks():
    sent = 0
    for chunk in state_chunks(state)[1]:
        yield chunk
        sent += len(chunk)
        if sent >= stop_after:
            time.sleep(3600)
ControlPlaneClient(url, token).upload_state(path, state_chunks(state)[0], chunks, 3600)
"""


@pytest.mark.django_db(transaction=True)
def test_an_upload_killed_after_some_parts_resumes_sending_only_the_others_and_a_broken_download_resumes(
    live_server, user, agents, queued_job, s3_server, settings, monkeypatch
) -> None:
    part = 5 << 20  # S3's least
    settings.ARCEUS_CHECKPOINT_PART_BYTES = part
    storage = CountingRelay(s3_server.env["AWS_S3_ENDPOINT_URL"])  # agents and control plane reach the bucket here
    settings.STORAGES = {
        **settings.STORAGES,
        "checkpoints": checkpoint_storage_settings({**s3_server.env, "AWS_S3_ENDPOINT_URL": storage.url}),
    }
    for model in (StageCheckpoint, CheckpointUpload):
        monkeypatch.setattr(model._meta.get_field("file"), "storage", checkpoint_storage())
    width = 36_000  # stage 0: 18.4 MB, 4 parts (the last short)
    job = queued_job(model_config={"type": "mlp", "layer_sizes": [64, width, 1, 10]})
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status="running")
    assert job_driver_claim(job_id=job.id, owner=DRIVER, now=timezone.now()) is not None
    job.refresh_from_db()
    upload = open_uploads(job, 10)[0]
    token = node_token_rotate(node=Node.objects.get(pk=upload.node_id), user=user)
    path = f"/api/agent/checkpoint-uploads/{upload.pk}"
    state = stage_state(0, width, 64, 0.25)  # what KILLED_AGENT sends
    size = state_chunks(state)[0]
    assert 3 * part < size < 4 * part
    key = f"checkpoints/{job.id}/step-00000010/stage-0-{upload.pk}.safetensors"

    def stored_parts() -> list[int]:
        uploads = s3_server.client.list_multipart_uploads(Bucket="arceus-checkpoints").get("Uploads", [])
        return [p["Size"] for u in uploads if u["Key"] == key for p in s3_server.client.list_parts(
            Bucket="arceus-checkpoints", Key=key, UploadId=u["UploadId"]).get("Parts", [])]

    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_AGENT, live_server.url, token, path, str(width), str(2 * part + 1)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    try:
        deadline = time.monotonic() + 120
        while stored_parts() != [part, part]:  # it sent two parts and reads the third of its state
            assert killed.poll() is None and time.monotonic() < deadline, stored_parts()
            time.sleep(0.2)
    finally:
        killed.kill()
    assert killed.wait(10) == -signal.SIGKILL

    agent = ControlPlaneClient(live_server.url, token, timeout=60)  # the agent again (restarted)
    storage.up = 0
    storage.cut_up_after = 1 << 20  # part 3's first attempt breaks off after 1 MiB: it is sent again
    sha256 = agent.upload_state(path, size, lambda: state_chunks(state)[1], 300)
    missing = size - 2 * part
    assert storage.cuts == 1
    assert missing + (1 << 20) <= storage.up < missing + (1 << 20) + (256 << 10), (storage.up, missing)
    assert sha256 == checkpoint_digest(b"".join(bytes(c) for c in state_chunks(state)[1]))
    others = [state_file(i, i, i + 1, encode_checkpoint(stage_state(i, *shape, 0.0)))
              for i, shape in ((1, (1, width)), (2, (10, 1)))]
    checkpoint = save(job, 10, files=[StageStateFile(0, 0, 1, None, sha256, size, upload_id=str(upload.pk)), *others])
    sc = checkpoint.stages.get(stage_index=0)
    assert (sc.size_bytes, sc.sha256) == (size, sha256)
    assert multipart_uploads(s3_server.client) == []

    storage.down = 0
    storage.cut_down_after = size // 2  # the download breaks off halfway: it resumes there, by range
    loaded = agent.fetch_checkpoint(CheckpointRef(10, f"/api/agent/checkpoints/{sc.pk}", sc.sha256))
    assert storage.cuts == 2
    # Not sent again from its start: at most the chunk the agent was reading when it broke off comes twice.
    assert size <= storage.down < size + CHUNK_BYTES + (64 << 10), (storage.down, size)
    torch.testing.assert_close(loaded["optimizer.layers.0.bias.momentum_buffer"], state["layers.0.bias"])
    storage.close()
