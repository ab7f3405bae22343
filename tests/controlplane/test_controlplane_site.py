"""The schema, the API docs and the admin pages render."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.test import Client

from controlplane.controller.executor import reconcile_once

pytestmark = pytest.mark.django_db


def test_the_openapi_schema_is_valid_and_warning_free(tmp_path) -> None:
    # --fail-on-warn: every view documents its request and response shapes.
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))
    assert "/api/jobs/{job_id}/train/" in (tmp_path / "schema.yaml").read_text()


def test_schema_and_docs_are_served_without_login(client: Client) -> None:
    assert client.get("/api/schema/").status_code == 200
    assert client.get("/api/docs/").status_code == 200


def test_admin_pages_render(admin_client: Client, ready_node, queued_job) -> None:
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    reconcile_once()
    for page in ("job", "stage", "losspoint", "epochmetric", "checkpoint", "stagecontribution"):
        assert admin_client.get(f"/admin/jobs/{page}/").status_code == 200, page
    for page in ("node", "nodelease", "noderestart"):
        assert admin_client.get(f"/admin/nodes/{page}/").status_code == 200, page
    assert admin_client.get(f"/admin/jobs/job/{job.id}/change/").status_code == 200
    assert admin_client.get("/admin/jobs/job/?q=digits&status__exact=placing").status_code == 200
    assert admin_client.get("/admin/nodes/node/?paused__exact=1").status_code == 200
    for page in ("pricechange", "ledgerentry", "ledgerhourly"):
        assert admin_client.get(f"/admin/market/{page}/").status_code == 200, page


def test_healthz_answers_once_the_database_does(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
