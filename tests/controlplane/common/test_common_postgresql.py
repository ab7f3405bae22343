"""The PostgreSQL backend's health check: no round trip on a live connection, a reconnect on one the server
ended (controlplane/common/postgresql/base.py)."""

from __future__ import annotations

import os
import time

import psycopg
import pytest
from django.db import connection

pytestmark = pytest.mark.django_db(transaction=True)


def _server_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def _other_connection() -> psycopg.Connection:
    settings = connection.get_connection_params()
    return psycopg.connect(**{k: v for k, v in settings.items() if k != "cursor_factory"}, autocommit=True)


def test_a_live_idle_connection_is_usable_without_a_query() -> None:
    assert connection.vendor == "postgresql"
    pid = _server_pid()  # connected, idle
    with _other_connection() as other:
        def last_change() -> object:  # when the backend last went active or idle: any statement moves it
            return other.execute("SELECT state_change FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()

        before = last_change()
        assert connection.is_usable()
        assert last_change() == before  # nothing ran (Django's own check would have run `SELECT 1`)


def test_a_connection_the_server_ended_is_not_usable_and_the_next_request_reconnects() -> None:
    pid = _server_pid()
    with _other_connection() as other:
        assert other.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
    deadline = time.monotonic() + 5
    while connection.is_usable() and time.monotonic() < deadline:  # the FATAL and the close are on their way
        time.sleep(0.05)
    assert not connection.is_usable()
    connection.health_check_done = False  # a new request's first query checks again
    connection.close_if_health_check_failed()
    assert _server_pid() != pid  # a fresh connection


def test_the_check_works_on_a_descriptor_above_1024() -> None:
    """A web process holding thousands of agents' connections opens its database connections above select()'s
    limit: the check must not fail there (it did: "filedescriptor out of range in select()", a 500)."""
    connection.close()
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        pid = _server_pid()  # connects on a descriptor above them all
        assert connection.connection.fileno() > 1024
        assert connection.is_usable()
        with _other_connection() as other:
            other.execute("SELECT pg_terminate_backend(%s)", [pid])
        deadline = time.monotonic() + 5
        while connection.is_usable() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not connection.is_usable()
    finally:
        for fd in fillers:
            os.close(fd)
        connection.close()
