"""The job REST API: submit with validation, read back, start, cancel, and ownership."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from arceus.model.precision import PRECISIONS
from arceus.pipeline.schedule import SCHEDULES
from controlplane.jobs.models import Job, PipelineSchedule, Precision

pytestmark = pytest.mark.django_db


def submit(api: APIClient, body: dict[str, Any]) -> Any:
    return api.post("/api/jobs", body, format="json")


def test_submit_returns_the_job_detail(api: APIClient, digits_job: dict) -> None:
    response = submit(api, digits_job)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["status"] == "created"
    assert body["owner"] == "alice"
    assert body["epochs_requested"] == 2 and body["stages"] == 3
    # Stored normalised: defaults filled in by the dataset validation.
    assert body["dataset_config"] == {"name": "digits", "batch_size": 32, "val_batch_size": 360}
    assert body["placements"] == [] and body["loss_curve"] == [] and body["epochs"] == []
    assert body["conditions"] == [] and body["error"] == ""
    assert Job.objects.get(pk=body["id"]).optimizer == "sgd"


def test_submit_fills_defaults(api: APIClient) -> None:
    body = {"model_config": {"layer_sizes": [64, 10]}, "dataset_config": {"name": "digits"}}
    detail = submit(api, body).json()
    assert (detail["epochs_requested"], detail["micro_batches"], detail["optimizer"], detail["seed"]) == (
        1,
        1,
        "sgd",
        0,
    )
    assert detail["stages"] is None
    assert detail["name"] == "digits-mlp-1-layers"


INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("no model", {"model_config": None}, "model_config", "null"),
    ("model not an object", {"model_config": [1, 2]}, "model_config", "must be a JSON object"),
    ("no layer sizes", {"model_config": {"type": "mlp"}}, "model_config.layer_sizes", "is required"),
    ("bad layer size", {"model_config": {"layer_sizes": [64, 0, 10]}}, "model_config.layer_sizes[1]", "at least 1"),
    ("unknown model", {"model_config": {"type": "cnn", "layer_sizes": [64, 10]}}, "model_config.type", "unknown"),
    ("input width", {"model_config": {"layer_sizes": [784, 10]}}, "model_config.layer_sizes[0]", "64 features"),
    ("output width", {"model_config": {"layer_sizes": [64, 5]}}, "model_config.layer_sizes[1]", "10 classes"),
    ("unknown dataset", {"dataset_config": {"name": "cifar"}}, "dataset_config.name", "unknown dataset"),
    ("bad batch size", {"dataset_config": {"name": "digits", "batch_size": 0}}, "dataset_config.batch_size", ""),
    ("epochs zero", {"epochs": 0}, "epochs", "greater than or equal to 1"),
    ("epochs too many", {"epochs": 10_001}, "epochs", "less than or equal to 10000"),
    ("epochs a string", {"epochs": "5"}, "epochs", "JSON integer"),
    ("epochs a bool", {"epochs": True}, "epochs", "JSON integer"),
    ("lr zero", {"learning_rate": 0}, "learning_rate", "greater than 0"),
    ("lr negative", {"learning_rate": -0.1}, "learning_rate", "greater than 0"),
    ("micro-batches zero", {"micro_batches": 0}, "micro_batches", ""),
    ("micro-batches huge", {"micro_batches": 1025}, "micro_batches", "1024"),
    ("optimizer", {"optimizer": "rmsprop"}, "optimizer", "not a valid choice"),
    ("momentum one", {"momentum": 1.0}, "momentum", "less than 1"),
    ("weight decay", {"weight_decay": -1}, "weight_decay", ""),
    ("seed negative", {"seed": -1}, "seed", ""),
    ("stages zero", {"stages": 0}, "stages", ""),
    ("stages above layers", {"stages": 5}, "stages", "requested 5 stages but the model has 3 layers"),
    ("misspelt option", {"learning_rat": 0.1}, "learning_rat", "Unknown field"),
    (
        "checkpoint interval negative",
        {"checkpoint_interval_steps": -1},
        "checkpoint_interval_steps",
        "greater than or equal to 0",
    ),
    (
        "checkpoint interval huge",
        {"checkpoint_interval_steps": 1_000_001},
        "checkpoint_interval_steps",
        "less than or equal to 1000000",
    ),
    ("checkpoint interval a float", {"checkpoint_interval_steps": 2.5}, "checkpoint_interval_steps", "JSON integer"),
    ("checkpoint interval a string", {"checkpoint_interval_steps": "50"}, "checkpoint_interval_steps", "JSON integer"),
    ("checkpoint interval null", {"checkpoint_interval_steps": None}, "checkpoint_interval_steps", "null"),
    ("grace zero", {"node_grace_seconds": 0}, "node_grace_seconds", "greater than 0"),
    ("grace negative", {"node_grace_seconds": -2.0}, "node_grace_seconds", "greater than 0"),
    ("grace a string", {"node_grace_seconds": "10"}, "node_grace_seconds", "finite JSON number"),
    ("grace a bool", {"node_grace_seconds": True}, "node_grace_seconds", "finite JSON number"),
    ("schedule", {"schedule": "interleaved"}, "schedule", "not a valid choice"),
    ("precision", {"precision": "fp16"}, "precision", "not a valid choice"),
    ("transfer not an object", {"transfer": "int8"}, "transfer", "must be an object"),
    ("transfer null", {"transfer": None}, "transfer", "null"),
    ("transfer activations", {"transfer": {"activations": "topk"}}, "transfer.activations", "must be one of"),
    ("transfer gradients", {"transfer": {"gradients": "int4"}}, "transfer.gradients", "must be one of"),
    ("transfer block size", {"transfer": {"block_size": 3}}, "transfer.block_size", "must be an integer"),
    ("transfer top-k ratio", {"transfer": {"topk_ratio": 0}}, "transfer.topk_ratio", "(0, 1]"),
    ("transfer unknown key", {"transfer": {"activation": "int8"}}, "transfer.activation", "unknown field"),
]


@pytest.mark.parametrize(("case", "change", "field", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_input_is_a_400_naming_the_field_and_nothing_is_saved(
    api: APIClient, digits_job: dict, case: str, change: dict, field: str, message: str
) -> None:
    response = submit(api, {**digits_job, **change})
    assert response.status_code == 400, response.json()
    body = response.json()
    assert field in body["errors"], body
    assert message in " ".join(body["errors"][field])
    assert field in body["detail"]
    assert Job.objects.count() == 0


@pytest.mark.parametrize(
    ("options", "interval", "grace"),
    [
        ({}, 50, None),
        ({"checkpoint_interval_steps": 0, "node_grace_seconds": 2.5}, 0, 2.5),
        ({"checkpoint_interval_steps": 7, "node_grace_seconds": 30}, 7, 30.0),
        ({"node_grace_seconds": None}, 50, None),
    ],
)
def test_checkpoint_and_grace_options(
    api: APIClient, digits_job: dict, options: dict, interval: int, grace: float | None
) -> None:
    response = submit(api, {**digits_job, **options})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["checkpoint_interval_steps"], body["node_grace_seconds"]) == (interval, grace)
    job = Job.objects.get(pk=body["id"])
    assert (job.checkpoint_interval_steps, job.node_grace_seconds) == (interval, grace)


@pytest.mark.parametrize(
    ("options", "schedule", "transfer"),
    [
        ({}, "gpipe", {"activations": "fp32", "gradients": "fp32", "block_size": 64, "topk_ratio": 0.1}),
        (
            {"schedule": "1f1b", "transfer": {"activations": "int8", "gradients": "int8"}},
            "1f1b",
            {"activations": "int8", "gradients": "int8", "block_size": 64, "topk_ratio": 0.1},
        ),
        (
            {"transfer": {"activations": "bf16", "gradients": "topk", "block_size": 128, "topk_ratio": 1}},
            "gpipe",
            {"activations": "bf16", "gradients": "topk", "block_size": 128, "topk_ratio": 1.0},
        ),
    ],
)
def test_schedule_and_transfer_are_stored_normalised_and_shown(
    api: APIClient, digits_job: dict, options: dict, schedule: str, transfer: dict
) -> None:
    response = submit(api, {**digits_job, **options})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["schedule"], body["transfer"]) == (schedule, transfer)
    job = Job.objects.get(pk=body["id"])
    assert (job.schedule, job.transfer) == (schedule, transfer)
    assert api.get(f"/api/jobs/{job.id}").json()["transfer"] == transfer


def test_every_pipeline_schedule_can_be_chosen() -> None:
    assert set(PipelineSchedule.values) == set(SCHEDULES)


def test_bf16_precision_is_stored_and_shown_and_fp32_is_the_default(api: APIClient, digits_job: dict) -> None:
    assert submit(api, digits_job).json()["precision"] == "fp32"
    response = submit(api, {**digits_job, "precision": "bf16"})
    assert response.status_code == 201, response.json()
    assert Job.objects.get(pk=response.json()["id"]).precision == "bf16"
    assert api.get(f"/api/jobs/{response.json()['id']}").json()["precision"] == "bf16"


def test_every_precision_can_be_chosen() -> None:
    assert set(Precision.values) == set(PRECISIONS)


def test_missing_required_fields_are_each_named(api: APIClient) -> None:
    response = submit(api, {})
    assert response.status_code == 400
    assert set(response.json()["errors"]) == {"model_config", "dataset_config"}


def test_a_non_object_body_is_a_400(api: APIClient) -> None:
    response = api.post("/api/jobs", [1, 2], format="json")
    assert response.status_code == 400
    assert "non_field_errors" in response.json()["errors"]


def test_the_api_needs_a_token(digits_job: dict, db: None) -> None:
    response = APIClient().post("/api/jobs", digits_job, format="json")
    assert response.status_code == 401
    assert response.json() == {"detail": "Authentication credentials were not provided."}
    assert response["WWW-Authenticate"] == "Token"


def test_users_see_only_their_own_jobs(api: APIClient, other_api: APIClient, digits_job: dict) -> None:
    job_id = submit(api, digits_job).json()["id"]
    assert [j["id"] for j in api.get("/api/jobs").json()] == [job_id]
    assert other_api.get("/api/jobs").json() == []
    for call in (
        lambda: other_api.get(f"/api/jobs/{job_id}"),
        lambda: other_api.post(f"/api/jobs/{job_id}/train", {}, format="json"),
        lambda: other_api.post(f"/api/jobs/{job_id}/cancel", {}, format="json"),
        lambda: other_api.post(f"/api/network/train/{job_id}", {}, format="json"),
    ):
        response = call()
        assert response.status_code == 404
        assert response.json() == {"detail": f"job {job_id} not found"}
    assert Job.objects.get(pk=job_id).status == "created"


def test_a_malformed_job_id_is_a_404(api: APIClient) -> None:
    response = api.get("/api/jobs/not-a-uuid")
    assert response.status_code == 404
    assert response.json() == {"detail": "job not-a-uuid not found"}


def test_train_queues_the_job_and_can_override_epochs_and_lr(api: APIClient, digits_job: dict) -> None:
    job_id = submit(api, digits_job).json()["id"]
    response = api.post(f"/api/jobs/{job_id}/train", {"epochs": 4, "learning_rate": 0.2}, format="json")
    assert response.status_code == 202, response.json()
    body = response.json()
    assert body["status"] == "queued"
    assert (body["epochs_requested"], body["learning_rate"]) == (4, 0.2)
    assert [(c["type"], c["status"], c["reason"]) for c in body["conditions"]] == [("Placed", "False", "Queued")]
    again = api.post(f"/api/jobs/{job_id}/train", {}, format="json")
    assert again.status_code == 409
    assert again.json()["detail"].endswith("is queued; only a created, failed or cancelled job can be started")


def test_train_validates_its_overrides(api: APIClient, digits_job: dict) -> None:
    job_id = submit(api, digits_job).json()["id"]
    response = api.post(f"/api/jobs/{job_id}/train", {"epochs": 0}, format="json")
    assert response.status_code == 400
    assert "epochs" in response.json()["errors"]
    assert Job.objects.get(pk=job_id).status == "created"


def test_the_seed_path_starts_a_job_too(api: APIClient, digits_job: dict) -> None:
    job_id = submit(api, digits_job).json()["id"]
    response = api.post(f"/api/network/train/{job_id}", {}, format="json")
    assert response.status_code == 202
    assert response.json()["status"] == "queued"


def test_cancel_then_restart(api: APIClient, digits_job: dict) -> None:
    job_id = submit(api, digits_job).json()["id"]
    api.post(f"/api/jobs/{job_id}/train", {}, format="json")
    cancelled = api.post(f"/api/jobs/{job_id}/cancel", {}, format="json")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    twice = api.post(f"/api/jobs/{job_id}/cancel", {}, format="json")
    assert twice.status_code == 409
    assert twice.json() == {"detail": f"job {job_id} already cancelled; there is nothing to cancel"}
    restarted = api.post(f"/api/jobs/{job_id}/train", {}, format="json")
    assert restarted.json()["status"] == "queued" and restarted.json()["finished_at"] is None


@pytest.mark.parametrize("suffix", ["", "/"])
def test_paths_work_with_and_without_a_trailing_slash(api: APIClient, digits_job: dict, suffix: str) -> None:
    created = api.post(f"/api/jobs{suffix}", digits_job, format="json")
    assert created.status_code == 201
    job_id = created.json()["id"]
    assert api.get(f"/api/jobs{suffix}").status_code == 200
    assert api.get(f"/api/jobs/{job_id}{suffix}").status_code == 200
    assert api.post(f"/api/jobs/{job_id}/train{suffix}", {}, format="json").status_code == 202
    assert api.post(f"/api/jobs/{job_id}/cancel{suffix}", {}, format="json").status_code == 200


def test_list_items_are_summaries(api: APIClient, digits_job: dict) -> None:
    submit(api, digits_job)
    [item] = api.get("/api/jobs").json()
    assert set(item) == {
        "id",
        "name",
        "owner",
        "status",
        "epochs_requested",
        "epoch",
        "step",
        "total_steps",
        "last_loss",
        "val_accuracy",
        "created_at",
        "started_at",
        "finished_at",
    }
