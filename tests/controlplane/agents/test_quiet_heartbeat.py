"""The quiet heartbeat answered before Django (controlplane/agents/heartbeat.py), through the real ASGI application:
it answers as the API does, reads the database once, and hands everything else to the API, which refuses a rotated
token, a deleted node or a disabled owner at once and judges every hostile body as before."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from a2wsgi import WSGIMiddleware
from django.core.wsgi import get_wsgi_application
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from rest_framework.test import APIClient
from schemathesis.core import NOT_SET

from controlplane.agents.heartbeat import quiet_heartbeats
from controlplane.celery import RECONCILE_TASK
from controlplane.common.dispatch import QUEUED_KEY
from controlplane.common.postgresql.async_connections import async_connections
from controlplane.common.redis_client import async_redis_client, redis_client
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job, Stage
from controlplane.nodes.liveness import lease_of
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for
from tasks.control import reconcile
from tests.controlplane.conftest import agent_register

# The quiet path reads through connections of its own, and Django's threads close theirs around each request: what
# a test writes must be committed to be seen.
pytestmark = pytest.mark.django_db(transaction=True)

# As controlplane/asgi.py composes it (whose import also refuses the tests' development secret key), on one event
# loop as in a web server's process.
application = quiet_heartbeats(WSGIMiddleware(get_wsgi_application(), workers=2))
LOOP = asyncio.new_event_loop()


@pytest.fixture(scope="module", autouse=True)
def _loop_connections_closed() -> Iterator[None]:
    yield

    async def close() -> None:
        await async_connections().close()
        await async_redis_client().aclose()

    LOOP.run_until_complete(close())
CAPABILITIES = {"device_type": "cpu", "device_name": "Test CPU", "memory_bytes": 8 * 2**30, "flops_fp32": 5e10}


def asgi_post(token: str, body: Any, *, raw: bytes | None = None, host: str = "testserver",
              extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> tuple[int, Any]:
    """POST /api/agent/heartbeat through the ASGI application, its body in two pieces: (status, JSON body)."""
    data = raw if raw is not None else json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/api/agent/heartbeat", "raw_path": b"/api/agent/heartbeat", "query_string": b"", "root_path": "",
        "server": ("testserver", 80), "client": ("127.0.0.1", 40000),
        "headers": [(b"host", host.encode()), (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()), (b"authorization", f"Node {token}".encode()),
                    *extra_headers],
    }
    pieces = [{"type": "http.request", "body": data[:10], "more_body": True},
              {"type": "http.request", "body": data[10:], "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pieces.pop(0) if pieces else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    LOOP.run_until_complete(application(scope, receive, send))
    code = sent[0]["status"]
    content = b"".join(m.get("body", b"") for m in sent[1:])
    return code, json.loads(content) if code != 400 or content.startswith(b"{") else content


def api_post(token: str, body: Any, *, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    """The same heartbeat through the API alone (Django's test client: no quiet path)."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    if raw is not None:
        response = client.post("/api/agent/heartbeat", raw, content_type="application/json")
    else:
        response = client.post("/api/agent/heartbeat", body, format="json")
    return response.status_code, response.json()


def to_django() -> dict[str, float]:
    """The heartbeats handed to Django so far, by reason (metrics.HEARTBEATS_TO_DJANGO)."""
    return {sample.labels["reason"]: sample.value for metric in REGISTRY.collect()
            if metric.name == "arceus_heartbeats_to_django" for sample in metric.samples
            if sample.name.endswith("_total")}


def ready_transitions() -> float:
    return REGISTRY.get_sample_value("arceus_node_ready_transitions_total", {"ready": "True"}) or 0.0


def handed(before: dict[str, float]) -> dict[str, float]:
    """The reasons counted since `before`, and how many times."""
    return {reason: n - before.get(reason, 0) for reason, n in to_django().items() if n != before.get(reason, 0)}


def registered(user: Any, name: str, port: int = 50051) -> tuple[Node, str, str]:
    """A node registered and Ready through the API: (node, token, the assignments version its agent holds)."""
    node, token = unready(user, name, port)
    status, body = api_post(token, {"observed": []})
    assert status == 200 and "assignments" in body
    return node, token, body["assignments_version"]


def unready(user: Any, name: str, port: int = 50051) -> tuple[Node, str]:
    """A node registered through the API, not heartbeating yet: (node, token)."""
    node, token = node_create(owner=user, name=name)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    address = f"127.0.0.1:{port}"
    response = agent_register(client, {"grpc_address": address, "capabilities": CAPABILITIES,
                                       "tls_certificate": identity_for(address).certificate})
    assert response.status_code == 200, response.content
    return node, token


def test_a_first_heartbeat_of_a_node_hosting_nothing_is_quiet_and_makes_it_ready(user) -> None:
    node, token = unready(user, "first")
    _, twin_token = unready(user, "twin", 50052)
    before, ready_before = to_django(), ready_transitions()
    status, body = asgi_post(token, {"observed": []})  # an agent holding no assignments sends no version
    assert handed(before) == {}
    assert status == 200 and body["assignments"] == [] and body["node_id"] == str(node.id)
    node.refresh_from_db()
    assert (node.ready_status, node.ready_reason) == ("True", "AgentReady")
    assert ready_transitions() == ready_before + 1
    twin_status, twin_body = api_post(twin_token, {"observed": []})  # the API's answer to the same heartbeat
    per_node = ("node_id", "relay")
    assert (status, {k: v for k, v in body.items() if k not in per_node}) == (
        twin_status, {k: v for k, v in twin_body.items() if k not in per_node})
    assert asgi_post(token, {"observed": [], "assignments_version": body["assignments_version"]})[1] == {
        k: v for k, v in body.items() if k != "assignments"}  # then quiet as ever: no assignments


def test_a_node_that_was_lost_is_ready_again_at_its_next_quiet_heartbeat(user) -> None:
    node, token, version = registered(user, "lost")
    Node.objects.filter(pk=node.pk).update(ready_status="Unknown", ready_reason="NodeStatusUnknown")
    before = to_django()
    assert asgi_post(token, {"observed": [], "assignments_version": version})[0] == 200
    assert handed(before) == {}
    node.refresh_from_db()
    assert (node.ready_status, node.ready_reason) == ("True", "AgentReady")


def test_a_quiet_heartbeat_is_answered_before_django_as_the_api_answers(user) -> None:
    node, token, version = registered(user, "quiet")
    before = lease_of(node.pk, timezone.now()).renewed_at
    beat = {"observed": [], "host_busy_fraction": 0.25, "relay": None, "assignments_version": version}
    with CaptureQueriesContext(connection) as queries:
        status, body = asgi_post(token, beat)
    assert status == 200
    # Not the API's path (three queries through Django's cursors): one prepared statement on PostgreSQL.
    assert len(queries) == (0 if connection.vendor == "postgresql" else 1)
    assert body == api_post(token, beat)[1]
    assert "assignments" not in body and body["node_id"] == str(node.id)
    liveness = lease_of(node.pk, timezone.now())
    assert liveness.renewed_at > before and liveness.host_busy_fraction == 0.25
    assert asgi_post(token, {"observed": [], "assignments_version": version})[0] == 200
    assert lease_of(node.pk, timezone.now()).host_busy_fraction is None  # not measured this time: dropped


def test_a_rotated_token_a_disabled_owner_and_a_deleted_node_are_refused_at_once(user, api) -> None:
    node, token, version = registered(user, "rotating")
    beat = {"observed": [], "assignments_version": version}
    before = to_django()
    assert asgi_post(token, beat)[0] == 200
    assert handed(before) == {}  # answered on the quiet path
    rotated = api.post(f"/api/nodes/{node.id}/token/rotate")
    assert rotated.status_code == 200
    status, body = asgi_post(token, beat)
    assert status == 401 and body["detail"].startswith("invalid node token: no node has it")
    token = rotated.json()["token"]
    assert asgi_post(token, beat)[0] == 200
    user.is_active = False
    user.save(update_fields=["is_active"])
    assert asgi_post(token, beat) == (401, {"detail": "the owner of this node is disabled"})
    user.is_active = True
    user.save(update_fields=["is_active"])
    Node.objects.filter(pk=node.pk).delete()
    status, body = asgi_post(token, beat)
    assert status == 401 and body["detail"].startswith("invalid node token: no node has it")
    assert handed(before) == {"token": 2, "owner": 1}  # why each went to Django, for the operator


def test_changed_assignments_are_answered_in_full(user, queued_job, api) -> None:
    agents = [registered(user, f"n{i}", 50061 + i) for i in range(3)]
    queued_job()
    reconcile_once()  # each node gets a stage: the versions the agents hold are stale
    before = to_django()
    for _, token, version in agents:
        status, body = asgi_post(token, {"observed": [], "assignments_version": version})
        assert status == 200 and len(body["assignments"]) == 1 and body["assignments_version"] != version
        held = body["assignments_version"]
        assert "assignments" not in asgi_post(token, {"observed": [], "assignments_version": held})[1]
    assert handed(before) == {"version": 3}
    node, token, _ = agents[0]
    before = to_django()
    held = asgi_post(token, {"observed": []})[1]["assignments_version"]
    assert handed(before) == {"first": 1}  # it hosts a stage: Django builds its assignments
    assert api.post(f"/api/nodes/{node.id}/pause").status_code == 200
    reconcile_once()  # the paused node's stage is handed back
    status, body = asgi_post(token, {"observed": [], "assignments_version": held})
    assert status == 200 and body["assignments_version"] != held and body["assignments"] == []


def test_assignments_built_ahead_are_answered_before_django_as_the_api_answers(user, queued_job) -> None:
    agents = [registered(user, f"p{i}", 50071 + i) for i in range(3)]
    job = queued_job()
    reconcile()  # the control worker's task: a pass places the job, then its nodes' assignments are built ahead
    before = to_django()
    for _, token, version in agents:
        beat = {"observed": [], "assignments_version": version}
        status, body = asgi_post(token, beat)
        assert status == 200 and len(body["assignments"]) == 1 and body["assignments_version"] != version
        assert body == api_post(token, beat)[1]  # what Django builds now
    assert handed(before) == {}
    node, token, version = agents[0]
    assert asgi_post(token, {"observed": []})[1]["assignments"]  # an agent that restarted: built ahead too
    Stage.objects.filter(job=job).update(generation=F("generation") + 1)  # changed since they were built
    status, body = asgi_post(token, {"observed": [], "assignments_version": version})
    assert status == 200 and body["assignments"][0]["generation"] == Stage.objects.get(node=node).generation
    assert handed(before) == {"version": 1}  # not the stale ones: Django built them


def test_a_hosting_agents_report_is_quiet_and_recorded_as_the_api_records_it(user, queued_job) -> None:
    agents = [registered(user, f"h{i}", 50081 + i) for i in range(3)]
    job = queued_job()
    reconcile_once()
    (node, token, _), (other, _, _) = agents[:2]
    version = asgi_post(token, {"observed": []})[1]["assignments_version"]
    stage, elsewhere = Stage.objects.get(node=node), Stage.objects.get(node=other)

    def beat(state: str, message: str = "", generation: int | None = None) -> dict[str, Any]:
        report = {"stage_id": stage.stage_id, "generation": stage.generation if generation is None else generation,
                  "state": state, "message": message}
        return {"observed": [report], "assignments_version": version, "host_busy_fraction": 0.5}

    def recorded() -> tuple[int | None, str, str]:
        stage.refresh_from_db()
        return stage.observed_generation, stage.observed_state, stage.observed_message

    for report, stored in [(beat("ready"), (stage.generation, "ready", "")),  # each a change, recorded before Django
                           (beat("failed", "out of memory"), (stage.generation, "failed", "out of memory")),
                           (beat("failed", "killed"), (stage.generation, "failed", "killed"))]:
        before, untouched = to_django(), Stage.objects.get(pk=elsewhere.pk).observed_state
        redis_client().delete(QUEUED_KEY.format(RECONCILE_TASK))
        status, body = asgi_post(token, report)
        assert status == 200 and handed(before) == {} and recorded() == stored
        assert redis_client().get(QUEUED_KEY.format(RECONCILE_TASK))  # the reconciler nudged, as by the API
        assert Stage.objects.get(pk=elsewhere.pk).observed_state == untouched  # the node's own row only
        with CaptureQueriesContext(connection) as queries:  # the same report again: nothing to record
            status, again = asgi_post(token, report)
        assert status == 200 and handed(before) == {} and recorded() == stored
        assert len(queries) == (0 if connection.vendor == "postgresql" else 1)
        assert body == again == api_post(token, report)[1]  # as the API answers it
    before = to_django()
    garbage = {"stage_id": "garbage", "generation": 0, "state": "ready"}  # names no stage: ignored by both paths
    for quiet in [beat("ready", generation=stage.generation + 1),  # about another placement: ignored by both
                  {**beat("failed", "killed"), "observed": [*beat("failed", "killed")["observed"], garbage]}]:
        assert asgi_post(token, quiet)[0] == 200
    assert handed(before) == {} and recorded() == (stage.generation, "failed", "killed")
    foreign = {"observed": [{"stage_id": elsewhere.stage_id, "generation": elsewhere.generation, "state": "ready"}],
               "assignments_version": version}
    assert asgi_post(token, foreign)[0] == 200  # another node's stage: the API reads the rows and ignores it
    assert handed(before) == {"observed": 1}
    elsewhere.refresh_from_db()
    assert elsewhere.observed_state == "pending"
    measured = {**beat("failed", "killed"), "link": {"rtt_seconds": 0.03, "bandwidth_bytes_per_second": 2e6}}
    assert asgi_post(token, measured)[0] == 200  # a measured link is the API's to record, reports unchanged or not
    assert handed(before) == {"observed": 1, "shape": 1}
    node.refresh_from_db()
    assert node.control_plane_rtt_seconds == 0.03 and job.stages.filter(observed_state="failed").count() == 1


def test_both_paths_answer_the_step_grants_of_the_jobs_a_node_hosts(user, queued_job) -> None:
    """Every answer carries each hosted job's step grant, read with the rows the version digests (no query more on
    the quiet path), and a grant that moves does not change the version: the heartbeat stays quiet."""
    agents = [registered(user, f"g{i}", 50091 + i) for i in range(3)]
    job = queued_job()
    reconcile_once()
    _, token, _ = agents[0]
    beat = {"observed": [], "assignments_version": asgi_post(token, {"observed": []})[1]["assignments_version"]}
    assert asgi_post(token, beat)[1]["step_grants"] == {} == api_post(token, beat)[1]["step_grants"]  # not running
    for grant in (8, 20):  # as a start, then a recorded step, set it
        Job.objects.filter(pk=job.pk).update(step_grant=grant)
        before = to_django()
        with CaptureQueriesContext(connection) as queries:
            status, body = asgi_post(token, beat)
        assert status == 200 and handed(before) == {} and "assignments" not in body
        assert len(queries) == (0 if connection.vendor == "postgresql" else 1)  # its one read, on its own connection
        assert body["step_grants"] == {str(job.id): grant}
        assert body == api_post(token, beat)[1]
    _, idle, _ = registered(user, "g-idle", 50099)
    assert asgi_post(idle, {"observed": []})[1]["step_grants"] == {}  # hosting nothing


@pytest.mark.parametrize(
    "beat",
    [
        {"observed": [], "assignments_version": "v", "host_busy_fraction": 1.5},
        {"observed": [], "assignments_version": "v", "host_busy_fraction": True},
        {"observed": [], "assignments_version": "v", "host_busy_fraction": "0.5"},
        {"observed": [], "assignments_version": " v "},
        {"observed": [], "assignments_version": "v" * 65},
        {"observed": [], "assignments_version": None},
        {"observed": [], "assignments_version": 7},
        {"observed": [{"stage_id": "x"}], "assignments_version": "v"},
        {"observed": [], "assignments_version": "v", "relay": {"attached": "not an address"}},
        {"observed": [], "assignments_version": "v", "relay": {"failed": ["h:1"] * 17}},
        {"observed": [], "assignments_version": "v", "relay": {"attached": "h:1", "extra": 1}},
        {"observed": [], "assignments_version": "v", "neighbour_links": "none"},
        {"observed": [], "assignments_version": "v", "link": {"rtt_seconds": -1}},
        {"observed": [], "assignments_version": "v", "unknown": 1},
        ["observed"],
    ],
)
def test_hostile_bodies_get_the_apis_answer(user, beat: Any) -> None:
    _, token, version = registered(user, "hostile")
    if isinstance(beat, dict) and beat.get("assignments_version") == "v":
        beat["assignments_version"] = version  # else only the version would keep it from being quiet
    before = to_django()
    assert asgi_post(token, beat) == api_post(token, beat)
    assert handed(before) == {"shape": 1}


@pytest.mark.parametrize("raw", [
    b'{"observed": [], "host_busy_fraction": NaN}', b'{"observed": [], "host_busy_fraction": 1e999}', b"{", b"\xff",
    b"x" * 9000, b"[" * 4000 + b"]" * 4000, b'{"observed": [], "assignments_version": "v\\u0000"}',
])
def test_bodies_that_are_not_json_or_too_large_get_the_apis_answer(user, raw: bytes) -> None:
    # (4,000 levels of nesting in under the quiet path's 8 kB: its parser recursed until the stack ran out.)
    _, token, _ = registered(user, "raw")
    status, body = asgi_post(token, None, raw=raw)
    assert status == 400 and body["detail"]
    assert (status, body) == api_post(token, None, raw=raw)


def test_a_host_that_allowed_hosts_refuses_is_refused_as_django_refuses_it(user) -> None:
    _, token, version = registered(user, "host")
    beat = {"observed": [], "assignments_version": version}
    assert asgi_post(token, beat)[0] == 200
    before = to_django()
    assert asgi_post(token, beat, host="evil.example")[0] == 400
    assert handed(before) == {"host": 1}


def test_a_repeated_header_is_judged_by_django(user) -> None:
    _, token, version = registered(user, "twice")
    beat = {"observed": [], "assignments_version": version}
    status, body = asgi_post(token, beat, extra_headers=((b"authorization", f"Node {token}".encode()),))
    assert status == 401 and body["detail"]  # WSGI joins the two with a comma: no such token


FUZZED_EXAMPLES = 60  # per source: the schema's valid and invalid bodies, and quiet-shaped ones


def quiet_shaped() -> st.SearchStrategy[dict[str, Any]]:
    """Bodies of the quiet heartbeat's shape with hostile values (non-finite numbers, NUL characters, odd types),
    stage reports among them."""
    anything = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80)
    report = st.fixed_dictionaries({"stage_id": anything, "generation": anything, "state": anything},
                                    optional={"message": anything})
    return st.fixed_dictionaries({"observed": st.lists(report, max_size=3)}, optional={
        "assignments_version": anything, "host_busy_fraction": anything, "neighbour_links": st.just([]) | anything,
        "relay": st.fixed_dictionaries({}, optional={"attached": anything, "failed": st.lists(anything, max_size=20)}),
    })


def test_fuzzed_heartbeats_through_the_asgi_front_are_never_server_errors(user) -> None:
    """schemathesis's bodies for the heartbeat (from /api/schema, valid and invalid) and quiet-shaped hostile ones,
    each through the ASGI front that answers quiet heartbeats itself: never a server error, always a JSON answer."""
    _, token, _ = registered(user, "fuzzed")
    schema = schemathesis.openapi.from_wsgi("/api/schema?format=json", get_wsgi_application())
    [heartbeat] = [op.ok() for op in schema.get_all_operations() if op.ok().label == "POST /api/agent/heartbeat/"]
    statuses: Counter[int] = Counter()
    before = to_django()

    def send(body: Any) -> None:  # sent as JSON, whatever media type a negative case meant its bytes for
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, answer = asgi_post(token, None, raw=raw)
        assert status < 500 and isinstance(answer, dict), (body, status, answer)
        statuses[status] += 1

    for strategy in [*(heartbeat.as_strategy(generation_mode=mode) for mode in schemathesis.GenerationMode),
                     quiet_shaped()]:
        @settings(max_examples=FUZZED_EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def one(case: Any) -> None:
            send(case if isinstance(case, dict) else case.body if case.body is not NOT_SET else {})

        one()
    handed_over = sum(handed(before).values())
    assert statuses[200] > 0 and statuses[400] > 0, statuses
    assert handed_over < sum(statuses.values())  # some were answered on the quiet path itself
