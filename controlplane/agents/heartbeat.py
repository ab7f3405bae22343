"""The heartbeat's answer, and the quiet heartbeat answered before Django.

Nearly every heartbeat changes nothing: its stage reports what is recorded already (or nothing, hosting none), the
node's assignments still the version the agent holds. `quiet_heartbeats` wraps the ASGI application
(controlplane/asgi.py: Django runs in its WSGI threads) and answers such a heartbeat on the event loop, without
Django's request machinery or a thread hand-off: one database read (the node by its token, its owner's state, the
rows its assignments version digests, what is recorded of those stages and their jobs' step grants) and one Redis
command (the lease), each shared by the heartbeats of one loop turn. Nothing is cached, so a rotated token, a
deleted node or a disabled owner is refused at once. It also answers a node's first heartbeat when it hosts nothing
(marking it Ready, `nodes_mark_ready`), changed assignments the control worker built ahead under the version just
read (controlplane/jobs/prepared_assignments.py), and the report of a change to the stages it names (a stage built
or failed: every placement brings one per stage, ~3,000 heartbeats while 1,000 jobs start), recorded in one
transaction for the heartbeats of a loop turn (`stages_record_changes`, by the API's rule). Its costs:
docs/BENCHMARKS.md.

It answers only heartbeats it is sure of and hands every other request to Django untouched (its body replayed): a
stage report that names a stage outside the node's assignments (one rule with the API's:
controlplane/jobs/stages.py), a measured link or any other field the API records
(schema.QUIET_FIELDS), a body the schema refuses, an unusual header, a Host that ALLOWED_HOSTS refuses, an unknown
token, a disabled owner, an unregistered node, or assignments that moved and were not built ahead. Both paths parse
the body with one schema (controlplane/nodes/schema.py); error bodies and every change a heartbeat carries stay in
`AgentHeartbeatApi` and `node_heartbeat`; both paths answer the same body (`heartbeat_body`). Why each heartbeat
went to Django is counted (metrics.HEARTBEATS_TO_DJANGO).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import cache
from typing import Any, NamedTuple

import psycopg
from django.conf import settings
from django.db import DatabaseError, connection
from django.http.request import split_domain_port, validate_host
from django.utils import timezone

from arceus.contracts.scrape import agent_scrape_digest
from arceus.json_input import json_loads_bounded
from controlplane.common import metrics
from controlplane.common.batching import Batched
from controlplane.common.conditions import TRUE
from controlplane.common.postgresql.async_connections import async_connections
from controlplane.jobs.models import Stage
from controlplane.jobs.prepared_assignments import prepared_assignments_read
from controlplane.jobs.selectors import (
    VERSION_COLUMNS,
    step_grants,
    version_digest,
    version_order,
    version_rows_join,
)
from controlplane.jobs.stages import StageRowKey, observed_changes, stages_record_changes
from controlplane.nodes.liveness import leases_renew_async
from controlplane.nodes.models import Node
from controlplane.nodes.relays import relay_assignment, relay_certificate
from controlplane.nodes.schema import Heartbeat, heartbeat_parse
from controlplane.nodes.services import node_token_hash, nodes_mark_ready

PATHS = frozenset({"/api/agent/heartbeat", "/api/agent/heartbeat/"})
MAX_QUIET_BYTES = 8192  # a quiet heartbeat's body is ~100 bytes (a relayed agent's ~1 kB at most)
JSON_TYPES = frozenset({"application/json", "application/json; charset=utf-8"})
# What Django's middleware adds to every answer (SecurityMiddleware, XFrameOptionsMiddleware) and DRF's Vary.
HEADERS = [(b"content-type", b"application/json"), (b"vary", b"Accept"), (b"x-frame-options", b"DENY"),
           (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"same-origin"),
           (b"cross-origin-opener-policy", b"same-origin")]
READ_HEADERS = frozenset({"authorization", "content-length", "content-type", "host", "x-forwarded-host",
                          "transfer-encoding"})

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


def heartbeat_body(*, node_id: str, version: str, max_threads: int | None, max_memory_bytes: int | None,
                   reachability: str, relay: dict[str, Any] | None, step_grants: dict[str, int]) -> dict[str, Any]:
    """The answer to a heartbeat, less its `assignments` (added when they changed). `step_grants`: the last training
    step each hosted job's agents may run (controlplane/jobs/step_grant.py), in every answer."""
    relay = relay or {}
    return {
        "node_id": node_id,
        "assignments_version": version,
        "step_grants": step_grants,
        "controls": {"max_threads": max_threads, "max_memory_bytes": max_memory_bytes},
        "heartbeat_interval_seconds": settings.ARCEUS_HEARTBEAT_INTERVAL_SECONDS,
        "relay": relay_assignment(node_id=node_id, reachability=reachability, attached=relay.get("attached"),
                                  failed=relay.get("failed", ()), now=time.time()),
        "relays": settings.ARCEUS_RELAYS,
        "relay_certificate": relay_certificate() or None,
        "metrics_token_sha256": agent_scrape_digest(settings.ARCEUS_METRICS_TOKEN, str(node_id)),
    }


def quiet_heartbeats(app: ASGIApp) -> ASGIApp:
    """`app` (Django, through the WSGI bridge: controlplane/asgi.py), with quiet heartbeats answered before it on
    the event loop (the module's docstring)."""

    async def application(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in PATHS or scope["method"] != "POST":
            return await app(scope, receive, send)
        headers = _single_headers(scope)
        length = headers.get("content-length", "") if headers is not None else ""
        if (headers is None or not length.isdigit() or int(length) > MAX_QUIET_BYTES or "transfer-encoding" in headers
                or headers.get("content-type", "").lower() not in JSON_TYPES):
            metrics.HEARTBEATS_TO_DJANGO.labels("shape").inc()
            return await app(scope, receive, send)
        body, more = b"", True
        while more and len(body) <= int(length):
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body, more = body + message.get("body", b""), message.get("more_body", False)
        if more or len(body) != int(length):
            answer: bytes | str = "shape"
        else:
            answer = await _answer_quiet(headers, body) if _allowed_host(headers) else "host"
        if isinstance(answer, str):
            metrics.HEARTBEATS_TO_DJANGO.labels(answer).inc()
            return await app(scope, _replayed(body, more, receive), send)  # Django reads the body again
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*HEADERS, (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    return application


def _single_headers(scope: dict[str, Any]) -> dict[str, str] | None:
    """The request's headers (lower-case names), or None when one the quiet path reads is repeated: WSGI joins
    repeats with commas, so Django, not this path, judges them."""
    headers: dict[str, str] = {}
    for name, value in scope["headers"]:
        key = name.decode("latin-1").lower()
        if key in headers and key in READ_HEADERS:
            return None
        headers[key] = value.decode("latin-1")
    return headers


def _replayed(body: bytes, more: bool, receive: Receive) -> Receive:
    """`receive`, the body already read coming first."""
    pending = [{"type": "http.request", "body": body, "more_body": more}]

    async def replay() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replay


async def _answer_quiet(headers: dict[str, str], raw: bytes) -> bytes | str:
    """The answer's bytes, or why Django must answer (a reason of metrics.HEARTBEATS_TO_DJANGO)."""
    token_hash = _token_hash(headers.get("authorization", ""))
    beat = _quiet_body(raw)
    if token_hash is None or beat is None:
        return "shape"
    held = beat.assignments_version or ""
    started = time.perf_counter()
    try:
        node = _quiet_node(await _ROWS(token_hash))
    except (DatabaseError, psycopg.Error):  # a broken connection: Django's path reconnects, or answers the error
        return "database"
    if isinstance(node, str):
        return node
    changes = observed_changes(beat.observed, node.hosted)
    if changes is None:
        return "observed"
    assignments: list[dict[str, Any]] | None = None
    if node.version != held:
        assignments = await _PREPARED((node.id, node.version)) if node.hosted else []
        if assignments is None:  # not built ahead (or expired): Django builds them
            return "version" if held else "first"
    now = timezone.now()
    await _RENEWALS((node.id, now, beat.host_busy_fraction))  # the lease first, as `node_heartbeat`
    if changes:
        try:
            await _OBSERVED([(node.id, *change) for change in changes])
        except DatabaseError:  # as a Ready transition's
            return "database"
    if not node.ready:
        try:
            await _READY((node.id, now))
        except DatabaseError:  # a batch's rows deadlocked with another writer's (a reachability sweep's): each
            return "database"  # node alone, through Django, locks one row and cannot
    metrics.HEARTBEATS.inc()
    body = heartbeat_body(node_id=node.id, version=node.version, max_threads=node.max_threads,
                          max_memory_bytes=node.max_memory_bytes, reachability=node.reachability,
                          relay=beat.relay, step_grants=node.step_grants)
    if assignments is not None:
        body["assignments"] = assignments
    metrics.HEARTBEAT_SECONDS.observe(time.perf_counter() - started)
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _allowed_host(headers: dict[str, str]) -> bool:
    """Whether Django would take the request's Host (ALLOWED_HOSTS); when not, or unsure, Django answers it."""
    if settings.USE_X_FORWARDED_HOST and "x-forwarded-host" in headers:
        return False
    domain, _ = split_domain_port(headers.get("host", ""))
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    return bool(domain) and validate_host(domain, allowed)


def _token_hash(header: str) -> str | None:
    """The hash of the token in `Authorization: Node <token>`, split as NodeTokenAuthentication splits it."""
    try:
        parts = header.encode("iso-8859-1").split()
    except UnicodeEncodeError:
        return None
    if len(parts) != 2 or parts[0].lower() != b"node" or not parts[1].isascii():
        return None
    return node_token_hash(parts[1].decode())


def _quiet_body(raw: bytes) -> Heartbeat | None:
    """The heartbeat when the schema takes it (controlplane/nodes/schema.py) and it carries nothing but what the
    quiet path judges; else None (the API then judges it, and names what is wrong)."""
    try:
        beat = heartbeat_parse(json_loads_bounded(raw, where=""))
    except ValueError:  # malformed JSON, nested too deep, a non-finite number or a NUL; or HeartbeatInvalid
        return None
    return beat if beat.quiet else None


async def _quiet_rows(token_hashes: list[str]) -> list[list[tuple[Any, ...]]]:
    """Each token's rows (`_quiet_sql`), read together."""
    if not _on_postgresql():  # SQLite (the demo, tests): Django's connection, in a thread
        rows = await asyncio.to_thread(_quiet_rows_django, token_hashes)
    else:
        # A prepared statement (each kept connection plans it once): planning it cost the server more than running it.
        async with async_connections().connection() as conn, conn.cursor() as cursor:
            await cursor.execute(_quiet_sql("= ANY(%s)"), [token_hashes], prepare=True)
            rows = await cursor.fetchall()
    by_token: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_token.setdefault(row[0], []).append(row[1:])
    return [by_token.get(token_hash, []) for token_hash in token_hashes]


@cache
def _on_postgresql() -> bool:
    # Read once: on the event loop, Django's `connection` is per task (asgiref's Local), and each batch's task
    # would make, then drop, a database wrapper of its own (reference cycles for the collector).
    return connection.vendor == "postgresql"


def _quiet_rows_django(token_hashes: list[str]) -> list[tuple[Any, ...]]:
    with _django_connection(), connection.cursor() as cursor:
        cursor.execute(_quiet_sql(f"IN ({', '.join(['%s'] * len(token_hashes))})"), token_hashes)
        return cursor.fetchall()


@contextmanager
def _django_connection() -> Iterator[None]:
    """What Django does to a thread's kept connection around each request (close_old_connections)."""
    connection.close_if_unusable_or_obsolete()
    try:
        yield
    finally:
        connection.close_if_unusable_or_obsolete()


async def _renew(renewals: list[tuple[str, datetime, float | None]]) -> list[None]:
    await leases_renew_async(renewals)  # type: ignore[arg-type]
    return [None] * len(renewals)


async def _record_observed(changes: list[list[tuple[Any, ...]]]) -> list[None]:
    """The stage reports that changed what is recorded (a stage built, or failed: one heartbeat per stage placed or
    moved), in a thread, in one transaction for the heartbeats of a loop turn."""

    def record() -> None:
        with _django_connection():
            stages_record_changes([change for node_changes in changes for change in node_changes])

    await asyncio.to_thread(record)
    return [None] * len(changes)


async def _mark_ready(marks: list[tuple[str, datetime]]) -> list[None]:
    """The nodes' Ready transition, in a thread: the first heartbeats of a fleet that starts, or that comes back
    after the control plane was away, arrive together; rare otherwise."""

    def mark() -> None:
        with _django_connection():
            nodes_mark_ready(node_ids=[node_id for node_id, _ in marks], now=max(now for _, now in marks))

    await asyncio.to_thread(mark)
    return [None] * len(marks)


# The heartbeats answered in one turn of the event loop share their database read, their lease renewal and
# their Ready transition.
_ROWS = Batched(_quiet_rows)
_RENEWALS = Batched(_renew)
_READY = Batched(_mark_ready)
_OBSERVED = Batched(_record_observed)
_PREPARED = Batched(prepared_assignments_read)


def _quiet_sql(tokens: str) -> str:
    """The rows of the nodes whose token hash is `tokens` (an SQL condition), the hash first."""
    return _quiet_sql_template().format(tokens=tokens)


@cache
def _quiet_sql_template() -> str:
    user = Node._meta.get_field("owner").related_model
    observed = (f"s.job_id, s.{connection.ops.quote_name('index')}, s.rank, s.replica, s.observed_generation, "
                "s.observed_state, s.observed_message")  # `QuietStage`, after the columns the version digests
    return (
        f"SELECT n.token_hash, n.id, u.is_active, n.registered_at IS NOT NULL, n.ready_status, "  # noqa: S608
        f"n.reachability, n.max_threads, n.max_memory_bytes, {VERSION_COLUMNS}, {observed}, j.step_grant "
        f"FROM {Node._meta.db_table} n "
        f"JOIN {user._meta.db_table} u ON u.{user._meta.pk.column} = n.owner_id "
        f"LEFT JOIN {version_rows_join('n.id')} WHERE n.token_hash {{tokens}} ORDER BY n.token_hash, {version_order()}"
    )


class QuietStage(NamedTuple):
    """What is recorded of a stage the node hosts (an `ObservedRow` of controlplane/jobs/stages.py)."""

    generation: int
    observed_generation: int | None
    observed_state: str
    observed_message: str


class QuietNode(NamedTuple):
    id: str
    reachability: str
    max_threads: int | None
    max_memory_bytes: int | None
    ready: bool
    version: str  # its assignments' current version
    hosted: dict[StageRowKey, QuietStage]  # the stages its assignments name (none: they are empty)
    step_grants: dict[str, int]  # their jobs' step grants (`step_grants`)


def _quiet_node(rows: list[tuple[Any, ...]]) -> QuietNode | str:
    """The node in `rows` (the token's: `_quiet_sql`) when its heartbeat may be quiet (its owner active, and it
    registered); else why not, a reason of metrics.HEARTBEATS_TO_DJANGO."""
    if not rows:
        return "token"
    node_id, active, registered, ready, reachability, max_threads, max_memory_bytes = rows[0][:7]
    if not active:
        return "owner"
    if not registered:
        return "unregistered"
    hosted = [row[7:] for row in rows if row[7] is not None]
    job_id = Stage._meta.get_field("job").to_python  # a UUID from PostgreSQL, its hex from SQLite
    stages = {(job_id(row[5]), *row[6:9]): QuietStage(row[1], *row[9:12]) for row in hosted}
    return QuietNode(str(Node._meta.pk.to_python(node_id)), reachability, max_threads, max_memory_bytes,
                     ready == TRUE, version_digest([row[:5] for row in hosted]), stages,
                     step_grants([(row[5], row[12]) for row in hosted]))
