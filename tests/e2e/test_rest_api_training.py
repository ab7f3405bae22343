"""A newcomer signs up over REST, submits a job with the token sign-up gave, three agents (another owner's)
train it to success; then the newcomer rotates the token: the old one is refused, the new one works.

Real processes throughout: gunicorn on PostgreSQL, Celery worker and beat on Redis, three node
agents talking gRPC to each other on loopback.
"""

from __future__ import annotations

import math
import secrets

import pytest
import requests

from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.sdk import ApiError, ArceusClient
from devtools.cluster import LocalCluster

pytestmark = pytest.mark.slow

JOB = {
    "name": "e2e-digits",
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 64, "val_batch_size": 360},
    "epochs": 3,
    "learning_rate": 0.05,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 4,
    "seed": 0,
    "stages": 3,
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}


def test_a_newcomer_signs_up_and_trains_a_job_across_three_agents_to_success(cluster: LocalCluster) -> None:
    agents = cluster.start_agents([f"node-{i}" for i in range(3)])  # the demo user's nodes
    username = f"newcomer-{secrets.token_hex(4)}"  # users outlive the shared cluster's resets
    signup = requests.post(
        f"{cluster.api_url}/api/auth/register",
        json={"username": username, "email": f"{username}@example.org", "password": "lantern-harbour-violet"},
        timeout=30,
    )
    assert signup.status_code == 201, signup.text
    client = ArceusClient(cluster.api_url, signup.json()["token"])

    job = client.submit_job(JOB)
    assert job["status"] == "created"
    # The seed's path still starts a job.
    response = client.session.post(f"{cluster.api_url}/api/network/train/{job['id']}", json={}, timeout=30)
    assert response.status_code == 202, response.text

    final = client.wait(job["id"], timeout=240)
    train_samples = len(load_dataset(validate_dataset_config(JOB["dataset_config"]))[0])

    assert final["status"] == "succeeded", final.get("error")
    assert final["step"] == final["total_steps"] == 3 * math.ceil(train_samples / 64)
    placements = sorted(final["placements"], key=lambda p: p["stage_index"])
    assert [(p["layer_start"], p["layer_end"]) for p in placements] == [(0, 1), (1, 2), (2, 3)]
    assert {p["node_id"] for p in placements} == {a.node_id for a in agents}
    for p in placements:
        assert p["samples"] >= 3 * train_samples, p
        assert p["compute_seconds"] > 0
    assert placements[0]["bytes_sent"] > 0 and placements[-1]["bytes_received"] > 0
    assert len(final["loss_curve"]) == final["step"]
    assert final["loss_curve"][-1]["loss"] < final["loss_curve"][0]["loss"]
    assert [e["epoch"] for e in final["epochs"]] == [1, 2, 3]
    assert final["val_accuracy"] >= 0.85

    nodes = {n["id"]: n for n in cluster.client.nodes()}
    for agent in agents:
        assert nodes[agent.node_id]["ready"]["status"] == "True"
        metrics = requests.get(f"http://{agent.metrics_address}/metrics", params={"token": agent.metrics_token},
                               timeout=10).text
        assert "arceus_samples_processed_total" in metrics
        # Each agent uploaded its own stage's checkpoints: the state never passed through the driver.
        name = "arceus_state_bytes_uploaded_total "
        uploaded = next(float(line.split()[1]) for line in metrics.splitlines() if line.startswith(name))
        assert uploaded > 0

    old_token = signup.json()["token"]
    new_token = client.rotate_token()
    assert new_token != old_token
    with pytest.raises(ApiError) as refused:
        ArceusClient(cluster.api_url, old_token).jobs()
    assert refused.value.status == 401
    assert [j["id"] for j in client.jobs()] == [job["id"]]  # the client now sends the new token
