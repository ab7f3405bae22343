"""The original prototype's README flow (seed 003), over REST as written, after one login: submit the MNIST
job, register devices, initialize, train with epochs and a learning rate, and watch it run; and the transformer
job that names only its text file, started by train alone. The agents' side goes through the node services an
agent's requests reach; the driver is a Celery task not run here (tests/e2e train jobs to the end)."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.observed import ObservedStage
from controlplane.agents.services import node_heartbeat
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job
from tests.arceus.data.test_data_datasets import write_mnist
from tests.controlplane.conftest import ReadyNode

pytestmark = pytest.mark.django_db

# The seed's bodies, with the braces its text lost put back.
SEED_MLP_JOB = {
    "model_config": {"layer_sizes": [784, 128, 64, 10]},
    "dataset_config": {
        "name": "MNIST", "batch_size": 256, "val_batch_size": 1000, "normalize": {"mean": [0.1307], "std": [0.3081]},
    },
}
SEED_TRANSFORMER_JOB = {"model_config": {"type": "transformer"}, "dataset_config": {"source": "gpt/data.txt"}}


def logged_in(user: User) -> APIClient:
    """The one step the prototype did not have: a token for the requests that follow."""
    token = APIClient().post("/api/auth/token", {"username": user.username, "password": "alice-password"},
                             format="json").json()["token"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def test_the_seed_mlp_flow_submit_initialize_train(
    user: User, ready_node: ReadyNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_mnist(tmp_path / "mnist", n_train=64, n_val=16)
    monkeypatch.setenv("ARCEUS_DATA_DIR", str(tmp_path))  # where the operator keeps MNIST
    api = logged_in(user)
    submitted = api.post("/api/jobs", SEED_MLP_JOB, format="json")
    assert submitted.status_code == 201, submitted.json()
    job_id = submitted.json()["id"]

    # "Now, register your devices": contributors' (no single owner may hold every stage of a job).
    nodes = [ready_node(f"device-{i}", port=50071 + i, owner=User.objects.create_user(f"contributor-{i}"))
             for i in range(3)]
    initialized = api.post(f"/api/network/initialize/{job_id}")
    assert initialized.status_code == 202, initialized.json()
    assert initialized.json()["status"] == "queued"
    assert [(c["type"], c["status"]) for c in initialized.json()["conditions"]] == [("Placed", "False")]
    reconcile_once()
    placed = api.get(f"/api/jobs/{job_id}").json()
    assert placed["status"] == "placing" and placed["placements"]

    trained = api.post(f"/api/network/train/{job_id}", {"epochs": 10, "learning_rate": 0.1}, format="json")
    assert trained.status_code == 202, trained.json()
    assert (trained.json()["epochs_requested"], trained.json()["learning_rate"]) == (10, 0.1)

    # Each device's agent builds its stage and says so in its next heartbeat: then the training driver starts.
    job = Job.objects.get(pk=job_id)
    by_node = {n.pk: n for n in nodes}
    for stage in job.stages.filter(active=True):
        node_heartbeat(node=by_node[stage.node_id], observed=[ObservedStage(stage.stage_id, job.generation, "ready")],
                       now=timezone.now())
    reconcile_once()
    running = api.get(f"/api/jobs/{job_id}").json()
    assert running["status"] == "running"
    assert (running["epochs_requested"], running["learning_rate"]) == (10, 0.1)
    # Training has begun: asking for what it does is a no-op, asking for something else a 409 saying why.
    assert api.post(f"/api/network/train/{job_id}", {"epochs": 10}, format="json").status_code == 202
    changed = api.post(f"/api/network/train/{job_id}", {"epochs": 3}, format="json")
    assert changed.status_code == 409 and "fixed once training begins" in changed.json()["detail"]


def test_the_seed_transformer_flow_names_only_its_text_file(user: User, data_root: Path) -> None:
    (data_root / "gpt").mkdir()
    (data_root / "gpt" / "data.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    api = logged_in(user)
    submitted = api.post("/api/jobs", SEED_TRANSFORMER_JOB, format="json")
    assert submitted.status_code == 201, submitted.json()
    job = submitted.json()
    assert job["dataset_config"]["name"] == "text"  # a transformer reads the text dataset
    assert Job.objects.get(pk=job["id"]).dataset_config["source"] == str(data_root / "gpt" / "data.txt")

    started = api.post(f"/api/network/train/{job['id']}", {}, format="json")  # no initialize needed
    assert started.status_code == 202 and started.json()["status"] == "queued"


def test_a_seed_source_the_data_root_lacks_is_a_400_naming_it(user: User, data_root: Path) -> None:
    response = logged_in(user).post("/api/jobs", SEED_TRANSFORMER_JOB, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == {
        "dataset_config.source": ["no readable file 'gpt/data.txt' in the data root: name a file under it"]
    }
