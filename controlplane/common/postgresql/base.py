"""Django's PostgreSQL backend with a health check that costs no round trip (settings: the ENGINE of a
PostgreSQL DATABASE_URL).

A kept connection (CONN_MAX_AGE) is checked at each request's first query (CONN_HEALTH_CHECKS), so one that a
database restart broke reconnects instead of failing the request. Django's check is a `SELECT 1`: one of a
heartbeat's three round trips. A server that ends a connection (a restart, `pg_terminate_backend`, a crash)
closes its socket, or sends its FATAL first, so an idle connection with nothing to read is alive: only one with
something to read pays for the `SELECT 1`, which then decides. `poll`, not `select`: a web process holding
thousands of agents' connections has descriptors above select's limit of 1024.
"""

from __future__ import annotations

import select

from django.db.backends.postgresql import base
from psycopg.pq import TransactionStatus


def readable_now(fd: int) -> bool:
    """Whether the socket has something to read (for an idle connection: the server ended it)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self) -> bool:
        connection = self.connection
        if connection is None or connection.closed:
            return False
        if connection.info.transaction_status == TransactionStatus.IDLE and not readable_now(connection.fileno()):
            return True
        return super().is_usable()
