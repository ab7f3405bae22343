"""Uploaded datasets in an S3-compatible bucket (a real S3-API server, configured as an operator would): the pieces,
the joined file, and the driver's batch-at-a-time reads through the storage."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from rest_framework.test import APIClient
from safetensors.torch import save

from arceus.data.config import validate_dataset_config
from arceus.data.streaming import dataset_samples
from controlplane.datasets.models import Dataset, dataset_storage
from controlplane.datasets.tokens import dataset_samples_open
from controlplane.settings import checkpoint_storage_settings
from tests.controlplane.conftest import S3Server

pytestmark = pytest.mark.django_db


@pytest.fixture
def bucket(s3_server: S3Server, settings, monkeypatch: pytest.MonkeyPatch) -> Any:  # noqa: ANN001
    settings.STORAGES = {**settings.STORAGES, "datasets": checkpoint_storage_settings(s3_server.env)}
    monkeypatch.setattr(Dataset._meta.get_field("file"), "storage", dataset_storage())
    return s3_server.client


def keys(bucket: Any) -> list[str]:
    return sorted(o["Key"] for o in bucket.list_objects_v2(Bucket="arceus-checkpoints").get("Contents", []))


def test_an_upload_lands_in_the_bucket_and_the_driver_reads_it_from_there(
    api: APIClient, bucket: Any, user, django_capture_on_commit_callbacks  # noqa: ANN001
) -> None:
    assert type(dataset_storage()).__name__ == "S3Storage"
    x, y = torch.rand(30, 8), torch.arange(30) % 3
    data = save({"x": x, "y": y})
    body = {"name": "s3", "format": "safetensors", "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    dataset = api.post("/api/datasets", body, format="json").json()
    with django_capture_on_commit_callbacks(execute=True):
        for offset in range(0, len(data), 400):
            response = api.put(f"/api/datasets/{dataset['id']}/data?offset={offset}", data=data[offset : offset + 400],
                               content_type="application/octet-stream")
            assert response.status_code == 200, response.content
        assert len(keys(bucket)) == -(-len(data) // 400)  # one object per piece
        response = api.post(f"/api/datasets/{dataset['id']}/complete")
    assert response.status_code == 200 and response.json()["facts"]["samples"] == 30
    assert keys(bucket) == [f"datasets/{user.pk}/{dataset['id']}/data.safetensors"]
    cfg = validate_dataset_config({"name": "uploaded", "dataset_id": dataset["id"], "format": "safetensors",
                                   **response.json()["facts"]})
    with dataset_samples(cfg, lambda c: dataset_samples_open(owner_id=user.pk, dataset_config=c)) as (train, val):
        bx, by = train.take(torch.tensor([5, 2]))
        assert torch.equal(bx, x[[5, 2]]) and torch.equal(by, y[[5, 2]]) and len(val) == 3
