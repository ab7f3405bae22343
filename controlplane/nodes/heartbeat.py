"""The heartbeat's answer, and the quiet heartbeat answered before Django.

10,000 agents heartbeat 1,000 times a second, and nearly every heartbeat changes nothing: nothing to report, the
node already Ready, its assignments still the version the agent holds. Through Django and DRF such a heartbeat
cost about 1.8 ms of web CPU (middleware, request and serializer machinery, content negotiation, two database
round trips); `quiet_heartbeats` wraps the WSGI application and answers it with one database round trip (the
node by its token, its owner's state and its assignments version's rows, read together: nothing is cached, so a
rotated token, a deleted node or a disabled owner is refused at once) and one Redis round trip (the lease).

It only ever answers a heartbeat it is sure of, and hands every other request to Django untouched (its body
replayed): a body that is not exactly the quiet shape (any report, link, an unusual type or value, a large or
chunked body, a Host that ALLOWED_HOSTS refuses), a token no node has, a disabled owner, an unregistered or
not-Ready node, or a changed version. So validation, error bodies and every change a heartbeat carries stay where
they are (`AgentHeartbeatApi`, `node_heartbeat`), and the two paths answer the same body (`heartbeat_body`).
"""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

import psycopg
from django.conf import settings
from django.db import DatabaseError, connection
from django.http.request import split_domain_port, validate_host
from django.utils import timezone

from controlplane.common.conditions import TRUE
from controlplane.jobs.selectors import VERSION_COLUMNS, version_digest, version_order, version_rows_join
from controlplane.monitoring import metrics
from controlplane.nodes.liveness import lease_renew
from controlplane.nodes.models import Node
from controlplane.nodes.relays import relay_assignment, relay_certificate
from controlplane.nodes.services import node_token_hash
from controlplane.nodes.validators import validate_grpc_address

PATHS = frozenset({"/api/agent/heartbeat", "/api/agent/heartbeat/"})
MAX_QUIET_BYTES = 8192  # a quiet heartbeat's body is ~100 bytes (a relayed agent's ~1 kB at most)
JSON_TYPES = frozenset({"application/json", "application/json; charset=utf-8"})
KEYS = frozenset({"observed", "neighbour_links", "link", "host_busy_fraction", "relay", "assignments_version"})
MAX_RELAYS_REPORTED = 16  # as the API's RelayReportInput
# What Django's middleware adds to every answer (SecurityMiddleware, XFrameOptionsMiddleware) and DRF's Vary.
HEADERS = [("Content-Type", "application/json"), ("Vary", "Accept"), ("X-Frame-Options", "DENY"),
           ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "same-origin"),
           ("Cross-Origin-Opener-Policy", "same-origin")]

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def heartbeat_body(*, node_id: str, version: str, max_threads: int | None, max_memory_bytes: int | None,
                   reachability: str, relay: dict[str, Any] | None) -> dict[str, Any]:
    """The answer to a heartbeat, less its `assignments` (added when they changed)."""
    relay = relay or {}
    return {
        "node_id": node_id,
        "assignments_version": version,
        "controls": {"max_threads": max_threads, "max_memory_bytes": max_memory_bytes},
        "heartbeat_interval_seconds": settings.ARCEUS_HEARTBEAT_INTERVAL_SECONDS,
        "relay": relay_assignment(node_id=node_id, reachability=reachability, attached=relay.get("attached"),
                                  failed=relay.get("failed", ()), now=time.time()),
        "relays": settings.ARCEUS_RELAYS,
        "relay_certificate": relay_certificate() or None,
    }


def quiet_heartbeats(django_app: WSGIApp) -> WSGIApp:
    """`django_app`, with quiet heartbeats answered before it (the module's docstring)."""

    def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") not in PATHS or environ.get("REQUEST_METHOD") != "POST":
            return django_app(environ, start_response)
        length = environ.get("CONTENT_LENGTH") or ""
        if (not length.isdigit() or int(length) > MAX_QUIET_BYTES
                or environ.get("CONTENT_TYPE", "").lower() not in JSON_TYPES):
            return django_app(environ, start_response)
        body = environ["wsgi.input"].read(int(length))
        environ["wsgi.input"] = io.BytesIO(body)  # Django reads it again when the heartbeat is not quiet
        answer = _answer_quiet(environ, body) if _allowed_host(environ) else None
        if answer is None:
            return django_app(environ, start_response)
        start_response("200 OK", [*HEADERS, ("Content-Length", str(len(answer)))])
        return [answer]

    return application


def _answer_quiet(environ: dict[str, Any], raw: bytes) -> bytes | None:
    """The answer's bytes, or None when Django must answer."""
    token_hash = _token_hash(environ.get("HTTP_AUTHORIZATION", ""))
    beat = _quiet_body(raw)
    if token_hash is None or beat is None:
        return None
    started = time.perf_counter()
    # What Django does to its kept connection around each request (close_old_connections, on the one database
    # read here): closed when too old or broken, health-checked at its first use.
    connection.close_if_unusable_or_obsolete()
    try:
        node = _node_if_quiet(token_hash, beat["assignments_version"])
    except DatabaseError:  # a broken kept connection: Django's path reconnects, or answers the error as it does
        return None
    finally:
        connection.close_if_unusable_or_obsolete()
    if node is None:
        return None
    node_id, reachability, max_threads, max_memory_bytes = node
    lease_renew(node_id=node_id, now=timezone.now(), host_busy_fraction=beat.get("host_busy_fraction"))
    metrics.HEARTBEATS.inc()
    body = heartbeat_body(node_id=node_id, version=beat["assignments_version"], max_threads=max_threads,
                          max_memory_bytes=max_memory_bytes, reachability=reachability, relay=beat.get("relay"))
    metrics.HEARTBEAT_SECONDS.observe(time.perf_counter() - started)
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _allowed_host(environ: dict[str, Any]) -> bool:
    """Whether Django would take the request's Host (ALLOWED_HOSTS); when not, or unsure, Django answers it."""
    if settings.USE_X_FORWARDED_HOST and "HTTP_X_FORWARDED_HOST" in environ:
        return False
    domain, _ = split_domain_port(environ.get("HTTP_HOST", ""))
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


def _reject_constant(name: str) -> None:
    raise ValueError(name)  # NaN and Infinity are not JSON


def _quiet_body(raw: bytes) -> dict[str, Any] | None:
    """The body when it is a quiet heartbeat's, exactly as the API's serializer would take it unchanged; else None
    (the serializer then judges it, and names what is wrong)."""
    try:
        beat = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return None
    if not isinstance(beat, dict) or not beat.keys() <= KEYS:
        return None
    if beat.get("observed", []) != [] or beat.get("neighbour_links", []) != [] or beat.get("link") is not None:
        return None
    version = beat.get("assignments_version")
    if not isinstance(version, str) or not version or len(version) > 64 or version != version.strip():
        return None
    fraction = beat.get("host_busy_fraction")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, int | float)
                                 or not math.isfinite(fraction) or not 0 <= fraction <= 1):
        return None
    relay = beat.get("relay")
    if relay is not None and not _plain_relay_report(relay):
        return None
    return beat


def _plain_relay_report(relay: Any) -> bool:
    if not isinstance(relay, dict) or not relay.keys() <= {"attached", "failed"}:
        return False
    failed = relay.get("failed", [])
    if not isinstance(failed, list) or len(failed) > MAX_RELAYS_REPORTED:
        return False
    attached = relay.get("attached")
    return all(_plain_address(a) for a in failed) and (attached is None or _plain_address(attached))


def _plain_address(value: Any) -> bool:
    if not isinstance(value, str) or not value or len(value) > 255 or value != value.strip():
        return False
    try:
        validate_grpc_address(value)
    except Exception:  # noqa: BLE001 (whatever it raises, the serializer reports it)
        return False
    return True


def _quiet_rows(token_hash: str) -> list[tuple[Any, ...]]:
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_quiet_sql(), [token_hash])
            return cursor.fetchall()
    # A prepared statement on PostgreSQL (each kept connection plans it once): planning it cost the server more
    # than running it. Django's cursors bind client-side and never prepare, so a psycopg cursor on Django's
    # connection, checked as Django checks it, its errors Django's (and marking the connection for closing).
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(_quiet_sql(), [token_hash], prepare=True)
        return cursor.fetchall()


@cache
def _quiet_sql() -> str:
    user = Node._meta.get_field("owner").related_model
    return (
        f"SELECT n.id, u.is_active, n.registered_at IS NOT NULL, n.ready_status, n.reachability, "  # noqa: S608
        f"n.max_threads, n.max_memory_bytes, {VERSION_COLUMNS} FROM {Node._meta.db_table} n "
        f"JOIN {user._meta.db_table} u ON u.{user._meta.pk.column} = n.owner_id "
        f"LEFT JOIN {version_rows_join('n.id')} WHERE n.token_hash = %s ORDER BY {version_order()}"
    )


def _node_if_quiet(token_hash: str, version: str) -> tuple[str, str, int | None, int | None] | None:
    """(node id, reachability, max_threads, max_memory_bytes) of the node with this token when its heartbeat is
    quiet: its owner active, registered, Ready, its assignments still `version`. One round trip."""
    rows = _quiet_rows(token_hash)
    if not rows:
        return None
    node_id, active, registered, ready, reachability, max_threads, max_memory_bytes = rows[0][:7]
    if not (active and registered and ready == TRUE):
        return None
    if version_digest([row[7:] for row in rows if row[7] is not None]) != version:
        return None
    return str(Node._meta.pk.to_python(node_id)), reachability, max_threads, max_memory_bytes
