"""POST /api/jobs/<id>/sample: text from a running transformer job, sampled through the agent that hosts its
stage (a real agent serving gRPC in this process) by a real Celery worker on the sampling queue (a thread of this
process: `sampling_worker`), through the API, the SDK and the CLI (against a live server)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from arceus.cli import main as cli_main
from arceus.contracts.assignment import Assignment
from arceus.contracts.status import JobStatus
from arceus.data.tokenizer import split_text, train_bpe
from arceus.v1 import stage_pb2
from controlplane.accounts.services import user_token_get_or_create
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import assignments_for_node
from controlplane.jobs.services import job_start, job_submit
from devtools.pipeline import remember_identity
from nodeagent.agent import Agent
from tests.arceus.model.pattern_training import trained_on

MODEL = {"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8}


@pytest.fixture
def agent() -> Iterator[Agent]:
    started = Agent(device=torch.device("cpu"))
    started.start()
    remember_identity(started.grpc_address, started.identity)  # the node registered for it (ready_node) pins it
    try:
        yield started
    finally:
        started.stop(grace=1)


def make_job(
    user: User, source: Path, ready_node, agent: Agent, *, running: bool = True, model: dict[str, Any] = MODEL,
    pattern: tuple[int, ...] = (0, 1, 2, 3),
) -> Job:
    """A one-stage transformer job on the text in `source`, placed on `agent`'s node; with `running`, the agent
    hosts the stage with the weights of a model that learned `pattern` (tokens a=0 … d=3 for the char
    vocabulary of "abcd") and the job has trained 60 steps."""
    node = ready_node("sampler-node", port=agent.grpc_port)
    job = job_start(job=job_submit(
        owner=user, model_config=model, dataset_config={"name": "text", "source": source.name}, stages=1,
        requirements={"owner_diversity": False},  # one stage, on the user's own node
    ))
    reconcile_once()
    job.refresh_from_db()
    if running:
        agent.apply_assignments([Assignment.from_json(a) for a in assignments_for_node(node=node)])
        ref = stage_pb2.StageRef(job_id=str(job.id), stage_index=0, generation=job.generation)
        agent.registry.resolve(ref).runtime.load_state_tensors(trained_on(job.model_config, pattern))
        Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING, step=60)
        job.refresh_from_db()
    return job


@pytest.fixture
def abcd_text(tmp_path: Path, settings) -> Path:  # noqa: ANN001
    settings.ARCEUS_DATA_ROOT = tmp_path
    source = tmp_path / "abcd.txt"
    source.write_text("abcd" * 50, encoding="utf-8")
    return source


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("sampling_worker")
def test_the_owner_samples_text_that_continues_what_the_model_learned(
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent
) -> None:
    job = make_job(user, abcd_text, ready_node, agent)
    greedy = api.post(f"/api/jobs/{job.id}/sample", {"prompt": "bc", "length": 20, "temperature": 0}, format="json")
    assert greedy.status_code == 200, greedy.json()
    assert greedy.json() == {"text": "bc" + "dabc" * 5, "step": 60}

    body = {"prompt": "a", "length": 30, "temperature": 1.0, "seed": 3}
    sampled = api.post(f"/api/jobs/{job.id}/sample", body, format="json").json()["text"]
    assert len(sampled) == 31 and set(sampled) <= set("abcd")
    assert api.post(f"/api/jobs/{job.id}/sample", body, format="json").json()["text"] == sampled  # seeded


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("sampling_worker")
def test_a_llama_job_samples_through_its_agent(
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent  # noqa: ANN001
) -> None:
    llama = {
        "type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 8,
    }
    job = make_job(user, abcd_text, ready_node, agent, model=llama)
    greedy = api.post(f"/api/jobs/{job.id}/sample", {"prompt": "bc", "length": 20, "temperature": 0}, format="json")
    assert greedy.status_code == 200, greedy.json()
    assert greedy.json() == {"text": "bc" + "dabc" * 5, "step": 60}


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("sampling_worker")
def test_a_bpe_job_samples_through_its_own_tokenizer(
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent
) -> None:
    tokenizer = train_bpe(split_text("abcd" * 50)[0], 260)
    pattern = tokenizer.encode("abcd" * 8)
    assert len(pattern) < 32  # merged: fewer tokens than characters
    bpe_model = {**MODEL, "vocab": "bpe", "vocab_size": 260}
    job = make_job(user, abcd_text, ready_node, agent, model=bpe_model, pattern=tuple(pattern))
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
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent, body, field, message
) -> None:
    job = make_job(user, abcd_text, ready_node, agent)
    response = api.post(f"/api/jobs/{job.id}/sample", body, format="json")
    assert response.status_code == 400
    assert message in " ".join(response.json()["errors"][field])


@pytest.mark.django_db
def test_sampling_needs_a_trained_transformer_of_ones_own(
    api: APIClient, other_api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent, queued_job
) -> None:
    untrained = make_job(user, abcd_text, ready_node, agent, running=False)
    response = api.post(f"/api/jobs/{untrained.id}/sample", {}, format="json")
    assert response.status_code == 409
    assert f"job {untrained.id} is placing: its model is sampled through the agents" in response.json()["detail"]

    mlp = queued_job()
    response = api.post(f"/api/jobs/{mlp.id}/sample", {}, format="json")
    assert response.status_code == 409
    assert "only a llama or transformer job generates text" in response.json()["detail"]

    assert other_api.post(f"/api/jobs/{untrained.id}/sample", {}, format="json").status_code == 404


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("sampling_worker")
def test_the_cli_prints_a_sample_from_the_live_api(
    live_server, user: User, abcd_text: Path, ready_node, agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    job = make_job(user, abcd_text, ready_node, agent)
    token = user_token_get_or_create(user=user)
    argv = ["--url", live_server.url, "--token", token, "jobs", "sample", str(job.id)]
    assert cli_main([*argv, "--prompt", "ab", "--length", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "abcdabcd\n"
    assert cli_main([*argv, "--prompt", "xy"]) != 0
    assert "prompt" in capsys.readouterr().err


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("sampling_worker")
def test_a_stage_that_cannot_decode_is_a_503_naming_it(
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent
) -> None:
    job = make_job(user, abcd_text, ready_node, agent)
    agent.apply_assignments([])  # the agent let the stage go (it moved) before the job's status caught up
    response = api.post(f"/api/jobs/{job.id}/sample", {"prompt": "ab", "length": 3}, format="json")
    assert response.status_code == 503
    # It no longer knows the job's credentials either.
    stage = f"stage 0 (node {job.stages.get().node_id} at {agent.grpc_address})"
    assert f"{stage} could not decode: UNAUTHENTICATED" in response.json()["detail"]


@pytest.mark.django_db
def test_with_no_worker_to_sample_the_request_is_a_503_in_bounded_time(
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent, settings  # noqa: ANN001
) -> None:
    settings.ARCEUS_SAMPLE_TIMEOUT_SECONDS = 1
    job = make_job(user, abcd_text, ready_node, agent)
    started = time.monotonic()
    response = api.post(f"/api/jobs/{job.id}/sample", {"prompt": "ab", "length": 3}, format="json")
    assert response.status_code == 503 and time.monotonic() - started < 10
    assert f"sampling job {job.id}: no training worker answered within 1s" in response.json()["detail"]
