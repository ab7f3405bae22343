"""POST /api/jobs with a convnet: the image shape and class count come from the dataset; a text dataset
or a split is a 400 naming the field."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db


def test_a_convnet_job_is_stored_with_the_datasets_image_shape_and_classes(api: APIClient) -> None:
    body = {"model_config": {"type": "convnet", "channels": [4, 8]}, "dataset_config": {"name": "digits"}}
    response = api.post("/api/jobs", body, format="json")
    assert response.status_code == 201, response.json()
    job = Job.objects.get(pk=response.json()["id"])
    assert job.model_config == {"type": "convnet", "channels": [4, 8], "input_shape": [1, 8, 8], "classes": 10}
    assert job.name == "digits-convnet-3-layers"


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"dataset_config": {"name": "text"}}, "dataset_config.name", "image dataset"),
        ({"tensor_parallel": {"size": 2}}, "tensor_parallel", "only a transformer's or a llama's blocks split"),
    ],
)
def test_a_convnet_job_that_cannot_train_is_a_400(api: APIClient, changes: dict, field: str, fragment: str) -> None:
    body = {"model_config": {"type": "convnet"}, "dataset_config": {"name": "digits"}, **changes}
    response = api.post("/api/jobs", body, format="json")
    assert response.status_code == 400 and fragment in response.json()["errors"][field][0], response.json()
    assert not Job.objects.exists()
