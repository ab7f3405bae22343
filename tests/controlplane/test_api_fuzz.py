"""schemathesis fuzzes the live OpenAPI schema (/api/schema) through the WSGI app, as a tenant (API token)
and as a node agent (node token): valid and invalid requests for every operation, against real objects
(the tenant's job and node) as well as made-up ids. No answer may be a server error, and every answer must
be a status, content type and body the schema declares."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import schemathesis
from django.contrib.auth.models import User
from django.core.wsgi import get_wsgi_application
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from rest_framework.throttling import ScopedRateThrottle
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from controlplane.accounts.services import user_token_get_or_create
from controlplane.agents.services import node_register
from controlplane.datasets.services import dataset_create
from controlplane.jobs.services import job_submit
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for
from tests.controlplane.conftest import DIGITS_JOB

# Hundreds of requests, each generated from the schema: on a machine other work loads, beyond the suite's default.
pytestmark = pytest.mark.timeout(900)
CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Per operation and generation mode (valid, invalid). A tenant's many operations: enough for each to answer and the
# seeded objects to be reached (about 700 requests). The node's few operations keep more.
TENANT_EXAMPLES = 15
NODE_EXAMPLES = 40
UNTHROTTLED = dict.fromkeys(("login", "register", "estimate", "sample", "model", "node_create"), "1000000/min")
# Rotating the caller's token retires the credentials every later request is made with: fuzzed last.
RETIRES_CALLER = "POST /api/auth/token/rotate/"


@dataclass
class Tally:
    requests: int = 0
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    operations: set[str] = field(default_factory=set)  # those fuzzed


@dataclass
class World:
    """The tenant's own objects, so path parameters reach real rows as well as missing ones."""

    tenant_token: str
    node_token: str
    path_values: dict[str, str]


@pytest.fixture
def world(transactional_db: None) -> World:
    tenant = User.objects.create_user("fuzzer", password="fuzzer-password")
    node, node_token = node_create(owner=tenant, name="fuzz-node")
    node_register(
        node=node, grpc_address="127.0.0.1:50061", tls_certificate=identity_for("127.0.0.1:50061").certificate,
        device_type="cpu", device_name="fuzz cpu", memory_bytes=2**30, flops_fp32=1e9, now=timezone.now(),
    )
    job = job_submit(owner=tenant, **DIGITS_JOB)
    dataset = dataset_create(owner=tenant, name="fuzz", format="text", size_bytes=64, sha256="0" * 64)
    return World(
        tenant_token=user_token_get_or_create(user=tenant),
        node_token=node_token,
        path_values={"job_id": str(job.id), "node_id": str(node.id), "dataset_id": str(dataset.id)},
    )


@pytest.fixture
def schema(world: World, monkeypatch: pytest.MonkeyPatch) -> Iterator[schemathesis.BaseSchema]:
    # Fuzzing is a flood by design: the rate limits (tests/controlplane/test_throttling.py) would answer 429.
    monkeypatch.setattr(ScopedRateThrottle, "THROTTLE_RATES", UNTHROTTLED)
    # (Login, sign-up and password changes each hash a password: tests/conftest.py gives the tests a fast hasher.)
    yield schemathesis.openapi.from_wsgi("/api/schema?format=json", get_wsgi_application())


def fuzz(schema: schemathesis.BaseSchema, *, security: str, authorization: str, world: World, examples: int) -> Tally:
    tally = Tally()
    operations = [result.ok() for result in schema.get_all_operations()]
    operations.sort(key=lambda o: o.label == RETIRES_CALLER)
    for operation in operations:
        schemes = {name for requirement in operation.definition.raw.get("security", []) for name in requirement}
        if schemes and security not in schemes:  # public operations (login) go with either
            continue
        tally.operations.add(operation.label)
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            strategies = [operation.as_strategy(generation_mode=mode)]
            names = [parameter.name for parameter in operation.path_parameters]
            if names and all(name in world.path_values for name in names):
                strategies.append(operation.as_strategy(
                    generation_mode=mode, path_parameters={name: world.path_values[name] for name in names}
                ))
            try:
                run_cases(st.one_of(strategies), authorization=authorization, tally=tally, examples=examples)
            except Unsatisfiable:  # nothing to make invalid: an operation without parameters, or whose only
                # input besides its path (the world's, or a free string) is a body of bytes, which any bytes are
                assert mode is schemathesis.GenerationMode.NEGATIVE and all(
                    body.media_type == "application/octet-stream" for body in operation.body
                ), operation.label
    return tally


def run_cases(strategy: st.SearchStrategy, *, authorization: str, tally: Tally, examples: int) -> None:
    @settings(
        max_examples=examples, derandomize=True, deadline=None, database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def one(case: schemathesis.Case) -> None:
        tally.requests += 1
        try:
            response = case.call(headers={"Authorization": authorization})
            tally.statuses[(case.operation.label, response.status_code)] += 1
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, FailureGroup) as failure:  # keep going: one report of every distinct failure
            tally.failures.append(f"{case.operation.label}: {failure}")

    one()


def test_the_api_as_a_tenant(schema: schemathesis.BaseSchema, world: World) -> None:
    tally = fuzz(schema, security="tokenAuth", authorization=f"Token {world.tenant_token}", world=world,
                 examples=TENANT_EXAMPLES)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.requests >= 600
    assert {label for label, _ in tally.statuses} == tally.operations  # every operation answered
    # The seeded objects were reached, not only refused as missing.
    for label in ("GET /api/jobs/{job_id}/", "GET /api/nodes/{node_id}/", "POST /api/nodes/{node_id}/pause/"):
        assert tally.statuses[(label, 200)] > 0, label
    assert tally.statuses[("POST /api/jobs/{job_id}/train/", 202)] > 0
    assert tally.statuses[("GET /api/datasets/{dataset_id}/", 200)] > 0


def test_the_api_as_a_node(schema: schemathesis.BaseSchema, world: World) -> None:
    tally = fuzz(schema, security="nodeToken", authorization=f"Node {world.node_token}", world=world,
                 examples=NODE_EXAMPLES)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.requests >= 250
    assert {label for label, _ in tally.statuses} == tally.operations
    assert tally.statuses[("POST /api/agent/heartbeat/", 200)] > 0
    # (A valid registration needs a real certificate, which no generator invents: register only refuses here.)
