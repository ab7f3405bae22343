"""POST/DELETE /api/jobs/<id>/serve: a succeeded text job served for sampling. The reconciler places its final
checkpoint's stage on a real agent (gRPC in this process) for inference, the agent builds it without an optimizer
from the checkpoint's weights only, sampling goes through it, and stopping releases the node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from django.contrib.auth.models import User
from django.core.files.base import ContentFile
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.checkpoint import checkpoint_digest, decode_checkpoint, encode_checkpoint
from arceus.contracts.assignment import Assignment, CheckpointRef
from arceus.contracts.status import JobStatus
from arceus.safetensors_file import OPTIMIZER_PREFIX
from arceus.v1 import stage_pb2
from controlplane.agents.services import node_heartbeat
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Checkpoint, Job, Stage, StageCheckpoint
from controlplane.jobs.selectors import assignments_for_node
from controlplane.jobs.services import job_start, job_submit
from controlplane.nodes.models import Node
from devtools.pipeline import remember_identity
from nodeagent.agent import Agent
from tests.arceus.model.pattern_training import trained_on
from tests.controlplane.jobs.test_jobs_checkpoints import checkpoint_dir  # noqa: F401 (a fixture)
from tests.controlplane.jobs.test_jobs_sample import (  # noqa: F401 (abcd_text: a fixture)
    MODEL,
    abcd_text,
    make_job,
)


def stored_stage(ref: CheckpointRef) -> dict[str, torch.Tensor]:
    """What the agent fetches from the control plane (`/api/agent/checkpoints/<id>`), read from storage here."""
    stage = StageCheckpoint.objects.get(pk=ref.url.rsplit("/", 1)[1])
    with stage.file.open("rb") as handle:
        return decode_checkpoint(handle.read(), sha256=ref.sha256)


@pytest.fixture
def agent() -> Iterator[Agent]:
    started = Agent(device=torch.device("cpu"), load_checkpoint=stored_stage)
    started.start()
    remember_identity(started.grpc_address, started.identity)
    try:
        yield started
    finally:
        started.stop(grace=1)


def succeed(job: Job, *, step: int = 60, checkpoint_step: int = 60) -> Job:
    """The job as its driver leaves it: succeeded at `step`, its nodes released, with a checkpoint at
    `checkpoint_step` of the weights that learned "abcd" and Adam moments (which serving must not load)."""
    weights = trained_on(job.model_config, (0, 1, 2, 3))
    moments = {f"{OPTIMIZER_PREFIX}{name}.{key}": torch.zeros_like(w) for name, w in weights.items()
               for key in ("exp_avg", "exp_avg_sq")}
    data = encode_checkpoint({**weights, **moments})
    checkpoint = Checkpoint.objects.create(job=job, step=checkpoint_step, epoch=1, generation=job.generation)
    stage = job.stages.get(rank=0)  # a checkpoint is of the unsplit stage, whatever its ranks
    stored = StageCheckpoint(
        checkpoint=checkpoint, stage_index=0, layer_start=stage.layer_start, layer_end=stage.layer_end,
        sha256=checkpoint_digest(data), size_bytes=len(data),
    )
    stored.file.save("stage-0.safetensors", ContentFile(data), save=False)
    stored.save()
    Job.objects.filter(pk=job.pk).update(status=JobStatus.SUCCEEDED, step=step, generation=job.generation + 1)
    Stage.objects.filter(job=job).update(active=False)
    job.refresh_from_db()
    return job


def reconcile(*nodes: Node, agent: Agent) -> None:
    """A reconcile pass right after the nodes' heartbeats (their agents' reports: `agent`'s for its node), as a
    cluster would have them: the test's own slow steps (training the weights) must not look like silent nodes."""
    for node in nodes:
        hosted = agent.registry.observed() if node.grpc_address == agent.grpc_address else []
        node_heartbeat(node=node, observed=hosted, now=timezone.now())
    reconcile_once()


def serving_condition(api: APIClient, job: Job) -> dict:
    detail = api.get(f"/api/jobs/{job.id}").json()
    return next(c for c in detail["conditions"] if c["type"] == "Serving")


@pytest.mark.django_db(transaction=True)  # the sampling worker's thread reads committed rows
@pytest.mark.usefixtures("sampling_worker")
def test_a_served_job_samples_through_its_agent_until_serving_stops(
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent, checkpoint_dir: Path  # noqa: F811
) -> None:
    job = succeed(make_job(user, abcd_text, ready_node, agent, running=False))
    node = job.stages.get().node
    assert assignments_for_node(node=node) == []  # finished: nothing hosted
    greedy = {"prompt": "bc", "length": 20, "temperature": 0}
    refused = api.post(f"/api/jobs/{job.id}/sample", greedy, format="json")
    assert refused.status_code == 409
    assert "succeeded and is not served: serve it (POST /api/jobs/<id>/serve)" in refused.json()["detail"]

    asked = api.post(f"/api/jobs/{job.id}/serve", {}, format="json")
    assert asked.status_code == 202, asked.json()
    assert asked.json()["serving"] is True and asked.json()["status"] == "succeeded"
    not_yet = api.post(f"/api/jobs/{job.id}/sample", greedy, format="json")
    assert not_yet.status_code == 409 and "its stages are not ready (Requested" in not_yet.json()["detail"]

    reconcile(node, agent=agent)
    (assignment,) = [Assignment.from_json(a) for a in assignments_for_node(node=node)]
    assert assignment.inference and assignment.tensor_parallel is None
    assert assignment.checkpoint is not None and assignment.checkpoint.step == 60
    assert serving_condition(api, job)["reason"] == "Placed"

    agent.apply_assignments([assignment])
    ref = stage_pb2.StageRef(job_id=str(job.id), stage_index=0, generation=assignment.generation)
    runtime = agent.registry.resolve(ref).runtime
    assert runtime.optimizer is None and not any(p.requires_grad for p in runtime.layers.parameters())
    reconcile(node, agent=agent)  # its heartbeat reports the stage ready
    assert serving_condition(api, job)["status"] == "True"

    sampled = api.post(f"/api/jobs/{job.id}/sample", greedy, format="json")
    assert sampled.status_code == 200, sampled.json()
    assert sampled.json() == {"text": "bc" + "dabc" * 5, "step": 60}

    stopped = api.delete(f"/api/jobs/{job.id}/serve")
    assert stopped.status_code == 202 and stopped.json()["serving"] is False
    assert api.post(f"/api/jobs/{job.id}/sample", greedy, format="json").status_code == 409
    reconcile(node, agent=agent)
    assert not Stage.objects.filter(job=job, active=True).exists()
    assert assignments_for_node(node=node) == []
    assert serving_condition(api, job)["reason"] == "Stopped"
    # Asked again: placed again (a new generation), on the node that is free again.
    assert api.post(f"/api/jobs/{job.id}/serve", {"serving": True}, format="json").status_code == 202
    reconcile(node, agent=agent)
    assert Stage.objects.get(job=job, active=True).node == node
    assert api.post(f"/api/jobs/{job.id}/serve", {"serving": False}, format="json").json()["serving"] is False


@pytest.mark.django_db
def test_only_ones_own_succeeded_text_job_with_a_final_checkpoint_is_served(
    api: APIClient, other_api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent,  # noqa: F811
    queued_job, checkpoint_dir: Path,  # noqa: F811
) -> None:
    job = make_job(user, abcd_text, ready_node, agent, running=False)
    response = api.post(f"/api/jobs/{job.id}/serve", {}, format="json")
    assert response.status_code == 409
    assert f"job {job.id} is placing; only a succeeded job is served: serve it once it succeeded" in (
        response.json()["detail"]
    )
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING)
    assert "sample it while it runs (POST /api/jobs/<id>/sample)" in (
        api.post(f"/api/jobs/{job.id}/serve", {}, format="json").json()["detail"]
    )

    succeed(job, step=80, checkpoint_step=60)  # its last checkpoint is older than its last step
    response = api.post(f"/api/jobs/{job.id}/serve", {}, format="json")
    assert response.status_code == 409
    assert "has no checkpoint of its final step 80, which serving loads" in response.json()["detail"]

    mlp = queued_job()
    Job.objects.filter(pk=mlp.pk).update(status=JobStatus.SUCCEEDED)
    response = api.post(f"/api/jobs/{mlp.id}/serve", {}, format="json")
    assert response.status_code == 409 and "only a llama or transformer job is served" in response.json()["detail"]

    assert other_api.post(f"/api/jobs/{job.id}/serve", {}, format="json").status_code == 404
    assert other_api.delete(f"/api/jobs/{job.id}/serve").status_code == 404
    assert api.post("/api/jobs/not-a-uuid/serve", {}, format="json").status_code == 404

    bad = api.post(f"/api/jobs/{job.id}/serve", {"serving": "yes"}, format="json")
    assert bad.status_code == 400 and "Must be a JSON boolean" in bad.json()["errors"]["serving"][0]
    unknown = api.post(f"/api/jobs/{job.id}/serve", {"replicas": 2}, format="json")
    assert unknown.status_code == 400 and "Unknown field" in unknown.json()["errors"]["replicas"][0]
    # Stopping what is not served changes nothing (DELETE is idempotent).
    assert api.delete(f"/api/jobs/{job.id}/serve").status_code == 202
    assert not Job.objects.get(pk=job.pk).serving


@pytest.mark.django_db(transaction=True)  # the sampling worker's thread reads committed rows
@pytest.mark.usefixtures("sampling_worker")
def test_a_tensor_parallel_job_is_served_whole_on_one_agent_and_samples(
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent, checkpoint_dir: Path  # noqa: F811
) -> None:
    fast = ready_node("fast", port=agent.grpc_port, flops=2e9)
    other = ready_node("other", port=1)
    job = job_start(job=job_submit(
        owner=user, model_config=MODEL, dataset_config={"name": "text", "source": abcd_text.name}, stages=1,
        tensor_parallel={"size": 2}, requirements={"owner_diversity": False},  # on the user's own nodes
    ))
    reconcile_once()
    assert sorted(job.stages.values_list("rank", flat=True)) == [0, 1]  # trained over a group of two
    job = succeed(job)
    api.post(f"/api/jobs/{job.id}/serve", {}, format="json")
    reconcile(fast, other, agent=agent)
    assert list(job.stages.filter(active=True).values_list("rank", "node")) == [(0, fast.pk)]
    (assignment,) = [Assignment.from_json(a) for a in assignments_for_node(node=fast)]
    assert assignment.inference and assignment.tensor_parallel is None and assignment.num_stages == 1
    agent.apply_assignments([assignment])
    reconcile(fast, other, agent=agent)
    sampled = api.post(f"/api/jobs/{job.id}/sample", {"prompt": "bc", "length": 8, "temperature": 0}, format="json")
    assert sampled.status_code == 200, sampled.json()
    assert sampled.json()["text"] == "bc" + "dabcdabc"


@pytest.mark.django_db
def test_sampling_a_running_tensor_parallel_job_is_a_409_saying_to_serve_it(
    api: APIClient, user: User, abcd_text: Path, ready_node, agent: Agent  # noqa: F811
) -> None:
    job = make_job(user, abcd_text, ready_node, agent)
    Job.objects.filter(pk=job.pk).update(tensor_parallel={"size": 2})
    response = api.post(f"/api/jobs/{job.id}/sample", {"prompt": "ab", "length": 3}, format="json")
    assert response.status_code == 409
    assert "whose ranks do not decode for samplers; once it succeeded, serve it" in response.json()["detail"]
