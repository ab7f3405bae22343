"""Fixtures for the control plane's tests: users, authenticated API clients, and Ready nodes made
through the real services (the same path an agent takes)."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from celery.contrib.testing.worker import start_worker
from django.contrib.auth.models import Permission, User
from django.core.cache import cache
from django.test import Client
from django.utils import timezone
from moto.server import ThreadedMotoServer
from rest_framework.test import APIClient

from arceus.contracts.possession import possession_sign
from arceus.wire.tls import TlsIdentity, new_identity
from controlplane.accounts.services import user_token_get_or_create
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.celery import CONTROL_QUEUE, QUEUE_TASK_MODULES, SAMPLING_QUEUE, app
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job
from controlplane.jobs.services import job_start, job_submit
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create
from devtools.cluster import free_port
from devtools.pipeline import identity_for

DIGITS_JOB = {
    "name": "digits",
    "model_config": {"type": "mlp", "layer_sizes": [64, 32, 16, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 2,
    "learning_rate": 0.05,
    "micro_batches": 4,
    "optimizer": "sgd",
    "momentum": 0.9,
    "weight_decay": 0.0001,
    "seed": 3,
    "stages": 3,
    "requirements": {"owner_diversity": False},  # the fixtures' nodes all belong to one owner (alice)
}


@pytest.fixture
def digits_job() -> dict[str, Any]:
    """A valid POST /api/jobs body (a fresh copy each time)."""
    return copy.deepcopy(DIGITS_JOB)


@pytest.fixture
def user(db: None) -> User:
    return User.objects.create_user("alice", password="alice-password")


@pytest.fixture
def other_user(db: None) -> User:
    return User.objects.create_user("bob", password="bob-password")


@pytest.fixture
def operator(db: None) -> Client:
    """A staff user's admin session, allowed to view and change jobs, nodes and prices (so to run the admin's
    actions), not a superuser."""
    staff = User.objects.create_user("operator", password="operator-password", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(
        codename__in=["change_job", "change_node", "change_pricechange", "view_ledgerentry"]
    ))
    client = Client()
    client.force_login(staff)
    return client


def client_for(user: User) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {user_token_get_or_create(user=user)}")
    return client


@pytest.fixture(autouse=True)
def uncollected_static_files(settings) -> None:  # noqa: ANN001
    """Pages render without `collectstatic` (production's storage names files by the hash it computed there); the
    collected, hashed files are served in the end-to-end tests (tests/e2e/test_operator_browser.py)."""
    plain = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}
    settings.STORAGES = {**settings.STORAGES, "staticfiles": plain}


def agent_register(client: APIClient, body: dict[str, Any], identity: TlsIdentity | None = None) -> Any:
    """What an agent does to register: sign a fresh challenge with the TLS key of `body`'s certificate (`identity`;
    by default the one devtools.pipeline made for its address) and post the registration with the proof."""
    identity = identity or identity_for(body["grpc_address"])
    answer = client.post("/api/agent/challenge", format="json")
    if answer.status_code != 200:
        return answer
    challenge = answer.json()["challenge"]
    proof = possession_sign(identity.key_pem, challenge, body["tls_certificate"])
    return client.post("/api/agent/register", {**body, "challenge": challenge, "tls_proof": proof}, format="json")


@pytest.fixture(autouse=True)
def fresh_throttles() -> None:
    """Each test starts with no request counted against the API's rate limits (kept in the cache)."""
    cache.clear()


@pytest.fixture
def data_root(tmp_path: Path, settings) -> Path:  # noqa: ANN001
    """The operator's data root for tenants' dataset files: an empty directory of this test's."""
    root = tmp_path / "data"
    root.mkdir()
    settings.ARCEUS_DATA_ROOT = root
    return root


@dataclass(frozen=True)
class S3Server:
    env: dict[str, str]  # what an operator sets to keep files in its bucket (controlplane.settings)
    client: Any  # boto3's, for looking into the bucket


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    """A real S3-API server over HTTP on loopback (moto's server mode) with the bucket "arceus-checkpoints"."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "ARCEUS_CHECKPOINT_S3_BUCKET": "arceus-checkpoints",
        "AWS_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "test-key",
        "AWS_SECRET_ACCESS_KEY": "test-secret",
        "AWS_S3_REGION_NAME": "us-east-1",
    }
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test-key",
        aws_secret_access_key="test-secret",
    )
    client.create_bucket(Bucket="arceus-checkpoints")
    try:
        yield S3Server(env, client)
    finally:  # moto keeps its buckets per process: the next test starts with an empty one
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="arceus-checkpoints"):
            for entry in page.get("Contents", []):
                client.delete_object(Bucket="arceus-checkpoints", Key=entry["Key"])
        client.delete_bucket(Bucket="arceus-checkpoints")
        server.stop()


@pytest.fixture
def api(user: User) -> APIClient:
    return client_for(user)


@pytest.fixture
def other_api(other_user: User) -> APIClient:
    return client_for(other_user)


ReadyNode = Callable[..., Node]


@pytest.fixture
def ready_node(user: User) -> ReadyNode:
    """make(name, port=..., flops=..., memory=..., owner=...) → a registered node that has heartbeated (the user's,
    unless `owner` is another)."""

    def make(
        name: str,
        *,
        port: int | None = None,
        flops: float = 1e9,
        memory: int = 2**30,
        now: datetime | None = None,
        owner: User | None = None,
    ) -> Node:
        now = now or timezone.now()
        node, _ = node_create(owner=owner or user, name=name)
        address = f"127.0.0.1:{port or 50051}"
        # A key of its own (one key, one node), the address's static-pipeline one where the test names the port.
        identity = identity_for(address) if port is not None else new_identity()
        node_register(
            node=node,
            grpc_address=address, tls_certificate=identity.certificate,
            device_type="cpu",
            device_name="test cpu",
            memory_bytes=memory,
            flops_fp32=flops,
            now=now,
        )
        node_heartbeat(node=node, observed=[], now=now)
        node.refresh_from_db()
        return node

    return make


@pytest.fixture
def queued_job(user: User) -> Callable[..., Job]:
    def make(**overrides: object) -> Job:
        return job_start(job=job_submit(owner=user, **{**DIGITS_JOB, **overrides}))

    return make


@pytest.fixture
def running_job(ready_node: ReadyNode, queued_job: Callable[..., Job]) -> Job:
    """A job placed on three nodes whose driver was just enqueued (lease pending, no owner). Tests that need a
    running job of another kind define their own."""
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(
        status="running", driver_lease_owner="", driver_lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    job.refresh_from_db()
    return job


@pytest.fixture
def estimate_of(api: APIClient, django_capture_on_commit_callbacks) -> Callable[..., dict[str, Any]]:  # noqa: ANN001
    """estimate_of(job, client=api) → the finished estimate's body: POST /api/jobs/estimate (202), then what a
    control worker does (the task message is taken from the real Redis queue and its task run), then the
    owner's GET of the URL it was given."""
    run_control_tasks("")  # messages earlier tests left

    def estimate(job: dict[str, Any], client: APIClient = api) -> dict[str, Any]:
        with django_capture_on_commit_callbacks(execute=True):
            response = client.post("/api/jobs/estimate", job, format="json")
        assert response.status_code == 202, response.content
        assert response.json()["status"] == "pending" and response["Location"] == response.json()["url"]
        assert run_control_tasks("arceus.estimate") == [[response.json()["id"]]]
        return client.get(response["Location"]).json()

    return estimate


def run_control_tasks(name: str) -> list[list[Any]]:
    """Run the messages for task `name` waiting on the control queue as a worker would (others are dropped);
    their argument lists."""
    app.loader.import_default_modules()
    ran = []
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(CONTROL_QUEUE)
        try:
            while True:
                try:
                    message = queue.get(timeout=0.1)
                except queue.Empty:
                    return ran
                message.ack()
                if message.headers["task"] == name:
                    args, kwargs, _ = message.decode()
                    app.tasks[name](*args, **kwargs)
                    ran.append(list(args))
        finally:
            queue.close()


@pytest.fixture
def sampling_worker(settings) -> Iterator[None]:  # noqa: ANN001
    """A real Celery worker (Celery's own, in a thread of this process) consuming the sampling queue with the
    training worker's task module, as `celery worker -Q training,sampling -I tasks.training` does: what a sampling
    request waits for. Its thread has its own database connection: the test's rows must be committed
    (`django_db(transaction=True)`)."""
    settings.SECRET_KEY = "a-test-secret-that-is-not-the-development-key"  # a worker refuses that key at start-up
    importlib.import_module(QUEUE_TASK_MODULES[SAMPLING_QUEUE])
    with app.connection_for_write() as connection:
        connection.default_channel.queue_purge(SAMPLING_QUEUE)  # requests earlier tests left unanswered
    with start_worker(app, pool="solo", queues=[SAMPLING_QUEUE], perform_ping_check=False, shutdown_timeout=30):
        yield
