"""Request bodies are bounded: an oversized JSON body is a 413 naming the bound, never a 500, and never read;
the agents' checkpoint uploads have their own bound (tests/controlplane/jobs/test_jobs_checkpoints.py)."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db


def test_an_oversized_json_body_is_a_413_naming_the_bound(api: APIClient, digits_job: dict, settings) -> None:  # noqa: ANN001
    settings.ARCEUS_MAX_REQUEST_BYTES = 4096
    big = {**digits_job, "name": "x" * 5000}
    response = api.post("/api/jobs", json.dumps(big), content_type="application/json")
    assert response.status_code == 413
    assert response.json()["detail"].endswith("bytes; this endpoint takes at most 4,096")
    assert not Job.objects.exists()
    assert api.post("/api/jobs", digits_job, format="json").status_code == 201  # under the bound


def test_the_default_bound_is_one_mebibyte(api: APIClient, settings) -> None:  # noqa: ANN001
    assert settings.ARCEUS_MAX_REQUEST_BYTES == settings.DATA_UPLOAD_MAX_MEMORY_SIZE == 1 << 20
    body = json.dumps({"name": "n", "padding": "x" * (1 << 20)})
    assert api.post("/api/nodes", body, content_type="application/json").status_code == 413
    assert APIClient().post("/api/auth/token", body, content_type="application/json").status_code == 413


def test_cookies_headers_and_passwords_are_hardened_outside_debug(settings) -> None:  # noqa: ANN001
    assert settings.DEBUG is False
    assert settings.SESSION_COOKIE_SECURE and settings.CSRF_COOKIE_SECURE and settings.SESSION_COOKIE_HTTPONLY
    assert settings.SECURE_CONTENT_TYPE_NOSNIFF and settings.X_FRAME_OPTIONS == "DENY"
    assert settings.SECURE_PROXY_SSL_HEADER is None  # only when ARCEUS_PROXY_SSL_HEADER says the proxy sets it
    with pytest.raises(ValidationError, match="at least 12 characters"):
        validate_password("k7#pQ2!zx9")
    validate_password("k7#pQ2!zx9-Lm4")


@pytest.mark.parametrize("declared", ["\u00b2", "\u00b9\u00b2", "1e3", "-5", " 12"])
def test_a_content_length_that_is_no_decimal_number_is_a_4xx(api: APIClient, digits_job: dict, declared: str) -> None:
    # "²" passes str.isdigit() but not int(): it was a ValueError (500) in the middleware and the upload views.
    job = api.post("/api/jobs", digits_job, format="json").json()
    for path, body in ((f"/api/jobs/{job['id']}/initial-weights", b"abc"), ("/api/jobs", json.dumps(digits_job))):
        response = api.generic("PUT" if "weights" in path else "POST", path, body,
                               content_type="application/octet-stream" if "weights" in path else "application/json",
                               CONTENT_LENGTH=declared)
        assert 400 <= response.status_code < 500, (path, declared, response.status_code)
