"""A model too deep for the placement solver, or too large for the operator, is a 400 before anything runs."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("model", "dataset", "says"),
    [
        (
            {"layer_sizes": [64] * 1000 + [10]}, "digits",
            "has 1000 pipeline layers; this control plane takes at most 128",
        ),
        (
            {"type": "transformer", "n_layer": 100, "n_head": 64, "d_model": 16384, "block_size": 64}, "text",
            "parameters; this control plane takes at most 20,000,000,000",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/api/jobs/estimate", "/api/jobs"])
def test_an_oversized_model_is_refused_naming_the_limit(
    api: APIClient, model: dict, dataset: str, says: str, path: str
) -> None:
    response = api.post(path, {"model_config": model, "dataset_config": {"name": dataset}}, format="json")
    assert response.status_code == 400, response.json()
    [message] = response.json()["errors"]["model_config"]
    assert says in message


def test_the_limits_are_the_operators(api: APIClient, settings) -> None:  # noqa: ANN001
    settings.ARCEUS_MAX_MODEL_LAYERS = 2
    deep = {"model_config": {"layer_sizes": [64, 32, 16, 10]}, "dataset_config": {"name": "digits"}}
    assert api.post("/api/jobs/estimate", deep, format="json").status_code == 400
    settings.ARCEUS_MAX_MODEL_LAYERS = 3
    assert api.post("/api/jobs/estimate", deep, format="json").status_code == 202
