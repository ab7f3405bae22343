"""POST /api/jobs/<id>/sample: text from a transformer job's newest checkpoint, through the API, the SDK and
the CLI (against a live server)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.checkpoint import checkpoint_digest, encode_checkpoint
from arceus.cli import main as cli_main
from arceus.contracts.status import JobStatus
from arceus.data.tokenizer import split_text, train_bpe
from arceus.model.build import build_full_model, named_global_parameters
from arceus.model.registry import model_spec_from_config
from arceus.training.plan import StageStateFile
from controlplane.accounts.services import user_token_get_or_create
from controlplane.controller.executor import reconcile_once
from controlplane.controller.leases import job_driver_claim
from controlplane.jobs.checkpoints import checkpoint_save
from controlplane.jobs.models import Job, StageCheckpoint, checkpoint_storage
from controlplane.jobs.services import job_start, job_submit

MODEL = {"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8}
DRIVER = "driver-sample"


def state_file(index: int, layer_start: int, layer_end: int, data: bytes) -> StageStateFile:
    """A stage's state file as the driver hands it to the sink."""
    handle, name = tempfile.mkstemp(suffix=".safetensors")
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    return StageStateFile(index, layer_start, layer_end, Path(name), checkpoint_digest(data), len(data))


@pytest.fixture
def checkpoint_dir(settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    settings.STORAGES = {
        **settings.STORAGES,
        "checkpoints": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path)},
        },
    }
    monkeypatch.setattr(StageCheckpoint._meta.get_field("file"), "storage", checkpoint_storage())
    return tmp_path


def trained_on(config: dict[str, Any], pattern: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Weights of the job's model after learning the token sequence `pattern` repeated."""
    model = build_full_model(model_spec_from_config(config), seed=0)
    block = model_spec_from_config(config).block_size
    ids = torch.tensor([pattern[i % len(pattern)] for i in range((block + 1) * 32)]).view(32, block + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in named_global_parameters(model)}


def make_job(
    user: User, source: Path, ready_node, *, trained: bool = True, model: dict[str, Any] = MODEL,
    pattern: tuple[int, ...] = (0, 1, 2, 3),
) -> Job:
    """A one-stage transformer job on the text in `source`; with `trained`, a checkpoint at step 60 of a
    model that learned `pattern` (tokens a=0 … d=3 for the char vocabulary of "abcd")."""
    ready_node("sampler-node")
    job = job_start(job=job_submit(
        owner=user, model_config=model, dataset_config={"name": "text", "source": str(source)}, stages=1,
    ))
    reconcile_once()
    if trained:
        Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING)
        assert job_driver_claim(job_id=job.id, owner=DRIVER, now=timezone.now()) is not None
        job.refresh_from_db()
        layers = model_spec_from_config(job.model_config).num_layers
        data = encode_checkpoint(trained_on(job.model_config, pattern))
        saved = checkpoint_save(job_id=job.id, lease_owner=DRIVER, generation=job.generation, step=60, epoch=1,
                                stages=[state_file(0, 0, layers, data)])
        assert saved is not None
    return job


@pytest.fixture
def abcd_text(tmp_path: Path) -> Path:
    source = tmp_path / "abcd.txt"
    source.write_text("abcd" * 50, encoding="utf-8")
    return source


@pytest.mark.django_db
def test_the_owner_samples_text_that_continues_what_the_model_learned(
    api: APIClient, user: User, abcd_text: Path, ready_node, checkpoint_dir: Path
) -> None:
    job = make_job(user, abcd_text, ready_node)
    greedy = api.post(f"/api/jobs/{job.id}/sample", {"prompt": "bc", "length": 20, "temperature": 0}, format="json")
    assert greedy.status_code == 200, greedy.json()
    assert greedy.json() == {"text": "bc" + "dabc" * 5, "step": 60}

    body = {"prompt": "a", "length": 30, "temperature": 1.0, "seed": 3}
    sampled = api.post(f"/api/jobs/{job.id}/sample", body, format="json").json()["text"]
    assert len(sampled) == 31 and set(sampled) <= set("abcd")
    assert api.post(f"/api/jobs/{job.id}/sample", body, format="json").json()["text"] == sampled  # seeded


@pytest.mark.django_db
def test_a_bpe_job_samples_through_its_own_tokenizer(
    api: APIClient, user: User, abcd_text: Path, ready_node, checkpoint_dir: Path
) -> None:
    tokenizer = train_bpe(split_text("abcd" * 50)[0], 260)
    pattern = tokenizer.encode("abcd" * 8)
    assert len(pattern) < 32  # merged: fewer tokens than characters
    bpe_model = {**MODEL, "vocab": "bpe", "vocab_size": 260}
    job = make_job(user, abcd_text, ready_node, model=bpe_model, pattern=tuple(pattern))
    response = api.post(f"/api/jobs/{job.id}/sample", {"prompt": "abcd", "length": 6, "temperature": 0}, format="json")
    assert response.status_code == 200, response.json()
    text = response.json()["text"]
    assert len(text) > len("abcd") + 6 and text == ("abcd" * 20)[: len(text)]
    # Byte-level: a character the text never holds is a valid prompt.
    assert api.post(f"/api/jobs/{job.id}/sample", {"prompt": "z☃", "length": 2}, format="json").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"prompt": "az"}, "prompt", "uses 'z', which the training text never does"),
        ({"prompt": ""}, "prompt", "may not be blank"),
        ({"length": 0}, "length", "greater than or equal to 1"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"top_k": 3}, "top_k", "Unknown field"),
    ],
)
def test_bad_sampling_input_is_a_400_naming_the_field(
    api: APIClient, user: User, abcd_text: Path, ready_node, checkpoint_dir: Path, body, field, message
) -> None:
    job = make_job(user, abcd_text, ready_node)
    response = api.post(f"/api/jobs/{job.id}/sample", body, format="json")
    assert response.status_code == 400
    assert message in " ".join(response.json()["errors"][field])


@pytest.mark.django_db
def test_sampling_needs_a_trained_transformer_of_ones_own(
    api: APIClient, other_api: APIClient, user: User, abcd_text: Path, ready_node, queued_job, checkpoint_dir: Path
) -> None:
    untrained = make_job(user, abcd_text, ready_node, trained=False)
    response = api.post(f"/api/jobs/{untrained.id}/sample", {}, format="json")
    assert response.status_code == 409
    assert "has no checkpoint yet" in response.json()["detail"]

    mlp = queued_job()
    response = api.post(f"/api/jobs/{mlp.id}/sample", {}, format="json")
    assert response.status_code == 409
    assert "only a transformer job generates text" in response.json()["detail"]

    assert other_api.post(f"/api/jobs/{untrained.id}/sample", {}, format="json").status_code == 404


@pytest.mark.django_db(transaction=True)
def test_the_cli_prints_a_sample_from_the_live_api(
    live_server, user: User, abcd_text: Path, ready_node, checkpoint_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = make_job(user, abcd_text, ready_node)
    token = user_token_get_or_create(user=user)
    argv = ["--url", live_server.url, "--token", token, "jobs", "sample", str(job.id)]
    assert cli_main([*argv, "--prompt", "ab", "--length", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "abcdabcd\n"
    assert cli_main([*argv, "--prompt", "xy"]) != 0
    assert "prompt" in capsys.readouterr().err
