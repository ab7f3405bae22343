"""The endpoints a stranger or a runaway script could make expensive answer 429 past their rate (DRF throttling)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient
from rest_framework.throttling import ScopedRateThrottle

pytestmark = pytest.mark.django_db

JOB = {"model_config": {"layer_sizes": [64, 10]}, "dataset_config": {"name": "digits"}}


def test_password_guessing_is_slowed_by_client_address(user: User) -> None:
    client = APIClient()
    wrong = {"username": user.username, "password": "guess"}
    answers = [client.post("/api/auth/token", wrong, format="json").status_code for _ in range(10)]
    assert set(answers) == {400}  # a wrong password is a 400, ten times
    refused = client.post("/api/auth/token", wrong, format="json")
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert "throttled" in refused.json()["detail"]


def test_each_expensive_endpoint_has_its_own_limit_per_user(
    api: APIClient, other_api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        ScopedRateThrottle, "THROTTLE_RATES",
        {"login": "10/min", "estimate": "2/min", "sample": "2/min", "model": "2/min", "node_create": "2/min"},
    )
    for _ in range(2):
        assert api.post("/api/jobs/estimate", JOB, format="json").status_code == 202
        assert api.post("/api/nodes", {"name": "n"}, format="json").status_code == 201
    assert api.post("/api/jobs/estimate", JOB, format="json").status_code == 429
    assert api.post("/api/nodes", {"name": "n"}, format="json").status_code == 429
    assert api.get("/api/nodes").status_code == 200  # listing one's nodes is not limited
    assert other_api.post("/api/jobs/estimate", JOB, format="json").status_code == 202  # per user
    missing = "/api/jobs/00000000-0000-0000-0000-000000000000"
    for path, method in ((f"{missing}/sample", "post"), (f"{missing}/model", "get")):
        answers = [getattr(api, method)(path, {"prompt": "a"}, format="json").status_code for _ in range(3)]
        assert answers == [404, 404, 429], path
