"""Every REST endpoint, called by those who have no business with a victim tenant's objects: a stranger with
no credentials, another tenant, a node of another owner, and revoked credentials (a deleted API token, a
deleted node's token). Each is refused with the right code, learns nothing of the victim beyond what its own
request contained, and leaves the victim's job and node as they were.

The endpoints come from the URL resolver: a new one that is not classified below fails the test."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.forms.models import model_to_dict
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from rest_framework.throttling import ScopedRateThrottle

from controlplane.accounts.services import user_token_get_or_create
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.datasets.models import Dataset
from controlplane.datasets.services import dataset_create
from controlplane.jobs.models import Checkpoint, CheckpointUpload, Job, JobEstimate, StageCheckpoint
from controlplane.jobs.services import job_start, job_submit
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for
from tests.controlplane.conftest import DIGITS_JOB

pytestmark = pytest.mark.django_db

# Anyone may call these, by design: nothing of any tenant is behind them.
PUBLIC = {
    "healthz": "liveness for load balancers: says only whether the database and broker answer",
    "schema": "the OpenAPI description of the API: the same for everyone",
    "docs": "the Swagger UI page rendering that schema",
    "token-obtain": "login: exchanges a username and password for that user's token (throttled by address)",
    "register": "sign-up: a new account of one's own (throttled by address)",
}
# A tenant's own objects, addressed by id: anyone else gets 404, as for a missing one.
TENANT_OBJECTS = {
    "job-detail", "job-estimate-detail", "job-train", "network-initialize", "network-train", "job-cancel",
    "job-model", "job-sample", "job-serve", "job-initial-weights", "job-program",
    "dataset-detail", "dataset-data", "dataset-complete",
    "node-detail", "node-pause", "node-resume", "node-controls", "node-earnings", "node-token-rotate",
}
# The caller's own collections (or nothing stored): another tenant may call them, and sees only its own.
TENANT_COLLECTIONS = {"job-list", "job-estimate", "node-list", "market-prices", "dataset-list"}
# The caller's own account: rotating its token or changing its password (tested on their own below, since a
# rotation replaces the very credentials the attacker calls with).
OWN_ACCOUNT = {"token-rotate", "password-change"}
# The node-agent protocol (`Authorization: Node <token>`): objects addressed by id are the caller node's only.
AGENT_OBJECTS = {
    "agent-checkpoint", "agent-checkpoint-upload", "agent-checkpoint-upload-parts",
    "agent-checkpoint-upload-parts-complete", "agent-initial-weights", "agent-program", "agent-dataset-reads",
}
# Act on (or read) the calling node itself.
AGENT_OWN = {"agent-challenge", "agent-register", "agent-heartbeat", "agent-probe", "agent-leave", "agent-earnings"}
# The Django admin (staff sessions), the sign-up page, and the dashboard's pages and live documents (session
# login; strangers and other tenants are tested in tests/controlplane/dashboard).
NOT_REST = {"admin", "signup", "home"} | {
    p.name for p in get_resolver("controlplane.dashboard.urls").url_patterns if isinstance(p, URLPattern)
}
# Prometheus's: the operator's metrics token only (ARCEUS_METRICS_TOKEN), no user's or node's credentials.
METRICS = {"metrics", "metrics-agents"}

VICTIM_ADDRESS = "10.77.66.55:50999"
BODIES: dict[str, Any] = {
    "job-list": DIGITS_JOB,
    "job-estimate": DIGITS_JOB,
    "job-train": {},
    "network-train": {},
    "job-sample": {"prompt": "hello", "max_new_tokens": 4},
    "job-serve": {"serving": True},
    "node-list": {"name": "mine"},
    "dataset-list": {"name": "mine", "format": "text", "size_bytes": 10, "sha256": "ef" * 32},
    # Valid bodies, so that only the upload's owner can be why a stranger's call is refused.
    "agent-checkpoint-upload-parts": {"size_bytes": 10},
    "agent-checkpoint-upload-parts-complete": {"multipart_id": "theirs", "sha256": "ab" * 32, "size_bytes": 10},
    "node-controls": {"max_threads": 1},
    "agent-heartbeat": {"observed": []},
    "agent-probe": {},
    "agent-challenge": {},
}


@dataclass
class Endpoint:
    name: str
    methods: list[str]


def endpoints() -> list[Endpoint]:
    """Every named route, with the HTTP methods its view answers."""
    found: list[Endpoint] = []

    def walk(patterns: list[URLPattern | URLResolver]) -> None:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                if pattern.namespace == "admin":
                    found.append(Endpoint("admin", []))
                else:
                    walk(pattern.url_patterns)
                continue
            view = getattr(pattern.callback, "view_class", None)
            methods = [m for m in ("get", "post", "put", "patch", "delete") if view and hasattr(view, m)]
            found.append(Endpoint(pattern.name or "", methods))

    walk(get_resolver().url_patterns)
    return found


@dataclass
class Victim:
    user: User
    job: Job
    node: Node
    checkpoint: StageCheckpoint
    upload: CheckpointUpload
    estimate: JobEstimate
    dataset: Dataset
    secrets: list[str]
    node_token: str

    def kwargs(self) -> dict[str, str]:
        return {
            "job_id": str(self.job.id), "node_id": str(self.node.id),
            "checkpoint_id": str(self.checkpoint.id), "upload_id": str(self.upload.id),
            "estimate_id": str(self.estimate.id), "dataset_id": str(self.dataset.id),
        }

    def state(self) -> dict[str, Any]:
        job, node = Job.objects.get(pk=self.job.pk), Node.objects.get(pk=self.node.pk)
        return {
            "job": model_to_dict(job), "node": model_to_dict(node),
            "upload": model_to_dict(CheckpointUpload.objects.get(pk=self.upload.pk)),
            "jobs": Job.objects.filter(owner=self.user).count(), "nodes": Node.objects.filter(owner=self.user).count(),
            "dataset": model_to_dict(Dataset.objects.get(pk=self.dataset.pk), exclude=["file"]),
        }


@pytest.fixture
def victim() -> Victim:
    user = User.objects.create_user("victim", password="victim-password")
    node, node_token = node_create(owner=user, name="victim-node-7f3a")
    now = timezone.now()
    node_register(
        node=node, grpc_address=VICTIM_ADDRESS, tls_certificate=identity_for(VICTIM_ADDRESS).certificate,
        device_type="cpu", device_name="victim cpu 9c1e", memory_bytes=2**30, flops_fp32=1e9, now=now,
    )
    node_heartbeat(node=node, observed=[], now=now)
    job = job_start(job=job_submit(owner=user, **{**DIGITS_JOB, "name": "victim-job-5d2b"}))
    checkpoint = Checkpoint.objects.create(job=job, step=1, epoch=0, generation=job.generation)
    stage_checkpoint = StageCheckpoint.objects.create(
        checkpoint=checkpoint, stage_index=0, layer_start=0, layer_end=1, file="victim/stage-0", sha256="ab" * 32,
        size_bytes=10,
    )
    upload = CheckpointUpload.objects.create(
        job=job, node=node, stage_index=0, layer_start=0, layer_end=1, step=2, generation=job.generation
    )
    estimate = JobEstimate.objects.create(owner=user, request={**DIGITS_JOB, "name": "victim-estimate-e41c"})
    dataset = dataset_create(owner=user, name="victim-corpus-3b9d", format="text", size_bytes=10, sha256="cd" * 32)
    node.refresh_from_db()
    secrets = [
        str(job.id), str(node.id), str(checkpoint.id), str(stage_checkpoint.id), str(upload.id), str(estimate.id),
        str(dataset.id), "victim-corpus-3b9d", "victim-estimate-e41c", VICTIM_ADDRESS,
        "victim-node-7f3a", "victim-job-5d2b", "victim cpu 9c1e", "victim", node.tls_certificate,
    ]
    return Victim(user, job, node, stage_checkpoint, upload, estimate, dataset, secrets, node_token)


def client(authorization: str | None) -> APIClient:
    c = APIClient()
    if authorization:
        c.credentials(HTTP_AUTHORIZATION=authorization)
    return c


@pytest.fixture
def attackers(victim: Victim) -> dict[str, APIClient]:
    other = User.objects.create_user("mallory", password="mallory-password")
    _, other_node_token = node_create(owner=other, name="mallory-node")
    revoked = User.objects.create_user("former", password="former-password")
    revoked_token = user_token_get_or_create(user=revoked)
    Token.objects.filter(user=revoked).delete()
    deleted_node, deleted_node_token = node_create(owner=victim.user, name="retired")
    deleted_node.delete()  # an operator removed it (the admin); there is no REST delete
    return {
        "stranger": client(None),
        "other tenant": client(f"Token {user_token_get_or_create(user=other)}"),
        "other owner's node": client(f"Node {other_node_token}"),
        "revoked API token": client(f"Token {revoked_token}"),
        "deleted node's token": client(f"Node {deleted_node_token}"),
    }


def expected(name: str, attacker: str) -> set[int]:
    """The refusal each attacker must get from each kind of endpoint."""
    if attacker in ("stranger", "revoked API token", "deleted node's token"):
        return {401}
    node = attacker == "other owner's node"
    if name in TENANT_OBJECTS:
        return {401} if node else {404}
    if name in AGENT_OBJECTS:
        return {404} if node else {401}
    if name in AGENT_OWN:
        return {200, 400, 409} if node else {401}  # its own node: it is not registered yet (409) or no body (400)
    assert name in TENANT_COLLECTIONS, name
    return {401} if node else {200, 201, 202}  # its own (empty) lists, its own new job or node, an estimate


def call(c: APIClient, method: str, path: str, body: Any) -> Any:
    if method in ("get", "delete"):
        return getattr(c, method)(path)
    return getattr(c, method)(path, body, format="json")


def test_every_endpoint_is_classified() -> None:
    names = {e.name for e in endpoints()}
    classified = (
        PUBLIC.keys() | TENANT_OBJECTS | TENANT_COLLECTIONS | OWN_ACCOUNT | AGENT_OBJECTS | AGENT_OWN | NOT_REST
        | METRICS
    )
    assert names - classified == set(), "classify the new endpoint here: who may call it, and what a stranger gets"
    assert classified - names == set(), "a classified endpoint no longer exists"


def test_public_endpoints_need_no_credentials(db: None) -> None:
    assert client(None).get("/healthz").status_code in (200, 503)  # 503 only when a dependency is down
    assert client(None).get("/api/schema").status_code == 200
    assert client(None).get("/api/docs").status_code == 200
    assert client(None).post("/api/auth/token", {"username": "x", "password": "y"}, format="json").status_code == 400
    assert client(None).post("/api/auth/register", {"username": "x"}, format="json").status_code == 400
    assert client(None).get("/signup").status_code == 200


def test_nobody_but_the_owner_reaches_a_tenants_objects(victim: Victim, attackers: dict[str, APIClient]) -> None:
    before = victim.state()
    kwargs = victim.kwargs()
    tried = 0
    for endpoint in endpoints():
        if endpoint.name in PUBLIC or endpoint.name in NOT_REST or endpoint.name in OWN_ACCOUNT | METRICS:
            continue
        route = get_resolver().reverse_dict.getlist(endpoint.name)[0][0][0][1]
        path = reverse(endpoint.name, kwargs={k: kwargs[k] for k in route})
        body = BODIES.get(endpoint.name, {})
        for attacker, c in attackers.items():
            for method in endpoint.methods:
                response = call(c, method, path, body)
                tried += 1
                what = f"{attacker}: {method.upper()} {path}"
                assert response.status_code in expected(endpoint.name, attacker), (what, response.status_code)
                text = b"".join(response) if response.streaming else response.content
                sent = path + json.dumps(body)
                leaked = [s for s in victim.secrets if s not in sent and s.encode() in text]
                assert not leaked, (what, leaked, text[:300])
                if response.status_code >= 400:
                    assert set(response.json()) <= {"detail", "errors"}, what
    assert tried > 100
    after = victim.state()
    for key in ("job", "node", "upload", "jobs", "nodes"):
        assert after[key] == before[key], key


def test_account_endpoints_act_on_the_caller_alone(victim: Victim, attackers: dict[str, APIClient]) -> None:
    victim_token = user_token_get_or_create(user=victim.user)
    password = victim.user.password
    for attacker, c in attackers.items():
        for name, body in (("password-change", {"old_password": "victim-password", "new_password": "x" * 20}),
                           ("token-rotate", {})):
            response = c.post(reverse(name), body, format="json")
            if attacker == "other tenant":  # its own account: the victim's password is not its current one
                assert response.status_code == (400 if name == "password-change" else 200), (attacker, name)
            else:
                assert response.status_code == 401, (attacker, name, response.status_code)
    assert Token.objects.get(user=victim.user).key == victim_token
    victim.user.refresh_from_db()
    assert victim.user.password == password


def test_only_the_metrics_token_opens_the_metrics(victim: Victim, attackers: dict[str, APIClient], settings) -> None:  # noqa: ANN001
    settings.ARCEUS_METRICS_TOKEN = "m" * 40
    owner = client(f"Token {user_token_get_or_create(user=victim.user)}")
    for name in sorted(METRICS):
        for who, c in [*attackers.items(), ("the victim, a tenant", owner)]:
            response = c.get(reverse(name))
            assert response.status_code == 401, (who, name, response.status_code)
            assert not [s for s in victim.secrets if s.encode() in response.content], (who, name)


# Bodies that are not the API's to take, for every endpoint that parses one (each is refused before any service).
DEEP = "[" * 5_000 + "]" * 5_000
DEEPEST = "[" * 50_000 + "]" * 50_000  # about 100 kB: under the body limit
NUMBER = "__number__"
ACCOUNT_BODIES = {
    "token-obtain": {"username": "victim", "password": "victim-password"},
    "register": {"username": "newcomer", "password": "a long enough password"},
    "password-change": {"old_password": "victim-password", "new_password": "x" * 20},
}


def leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted path as the API names a field, value) of each string and number in a body."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in leaves(item, f"{path}.{key}" if path else key)]
    if isinstance(value, list):
        return [leaf for index, item in enumerate(value) for leaf in leaves(item, f"{path}[{index}]")]
    return [(path, value)]


def replaced(value: Any, path: str, new: Any, here: str = "") -> Any:
    if isinstance(value, dict):
        return {k: replaced(v, path, new, f"{here}.{k}" if here else k) for k, v in value.items()}
    if isinstance(value, list):
        return [replaced(v, path, new, f"{here}[{i}]") for i, v in enumerate(value)]
    return new if here == path else value


def bad_bodies(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(raw JSON, the field its refusal must name) for each way `body` can be spoilt: a NUL character in each
    string and in a key, NaN, Infinity and an out-of-range literal in each number, `true` for each integer, and
    nesting 5,000 and 50,000 deep in its first field."""
    first = next(iter(body))
    spoilt = [
        (json.dumps({**body, f"{first}\x00": 1}), "body"),
        (f'{{"{first}": {DEEP}}}', "body"), (f'{{"{first}": {DEEPEST}}}', "body"),
    ]
    for path, value in leaves(body):
        if isinstance(value, str):
            spoilt.append((json.dumps(replaced(body, path, value + "\x00")), path))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
                spoilt.append((json.dumps(replaced(body, path, NUMBER)).replace(f'"{NUMBER}"', literal), path))
            if isinstance(value, int):
                spoilt.append((json.dumps(replaced(body, path, True)), path))
    return spoilt


def test_bad_bodies_are_400s_naming_the_field_at_every_json_endpoint(
    victim: Victim, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hundreds of requests: the rate limits (tests/controlplane/test_throttling.py) would answer 429.
    unthrottled = dict.fromkeys(ScopedRateThrottle.THROTTLE_RATES, "1000000/s")
    monkeypatch.setattr(ScopedRateThrottle, "THROTTLE_RATES", unthrottled)
    owner = client(f"Token {user_token_get_or_create(user=victim.user)}")
    node = client(f"Node {victim.node_token}")
    kwargs, tried = victim.kwargs(), set()
    for endpoint in endpoints():
        body = BODIES.get(endpoint.name) or ACCOUNT_BODIES.get(endpoint.name)
        if not body:
            continue
        route = get_resolver().reverse_dict.getlist(endpoint.name)[0][0][0][1]
        path = reverse(endpoint.name, kwargs={k: kwargs[k] for k in route})
        c = node if endpoint.name in AGENT_OWN | AGENT_OBJECTS else owner
        for method in set(endpoint.methods) & {"post", "put", "patch"}:
            for raw, field in bad_bodies(body):
                response = getattr(c, method)(path, raw, content_type="application/json")
                what = f"{method.upper()} {path} {raw[:120]!r}"
                assert response.status_code == 400, (what, response.status_code, response.content[:300])
                assert field in response.json()["errors"], (what, response.json())
                tried.add(endpoint.name)
    assert tried == (BODIES.keys() | ACCOUNT_BODIES.keys()) - {"job-train", "network-train", "agent-probe",
                                                              "agent-challenge"}  # no body to spoil
