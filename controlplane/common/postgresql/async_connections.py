"""A web process's kept asynchronous PostgreSQL connections, for the one query the event loop runs itself (the
quiet heartbeat: controlplane/agents/heartbeat.py); everything else reaches the database through Django's own
connections, in the WSGI threads.

Made with Django's connection settings (the same database, user, TLS options and type adapters), in autocommit,
at most `SIZE` per event loop, kept between queries. A kept connection is checked as Django's backend checks it
(controlplane/common/postgresql/base.py): an idle one with something to read was ended by the server, so it is
closed and a new one opened; one that failed mid-query is closed, never reused.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from django.db import connections
from psycopg.pq import TransactionStatus

from controlplane.common.postgresql.base import readable_now

SIZE = 4  # queries in flight at once per web process: each takes well under a millisecond of the server


class AsyncConnections:
    def __init__(self, size: int = SIZE) -> None:
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(size)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with self._slots:
            conn = await self._take()
            try:
                yield conn
            except BaseException:
                await conn.close()
                raise
            if conn.closed or conn.info.transaction_status != TransactionStatus.IDLE:
                await conn.close()
            else:
                self._idle.append(conn)

    async def close(self) -> None:
        while self._idle:
            await self._idle.pop().close()

    async def _take(self) -> psycopg.AsyncConnection[Any]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and not readable_now(conn.fileno()):  # an idle one the server ended has input
                return conn
            await conn.close()
        params = connections["default"].get_connection_params()
        params.pop("cursor_factory", None)  # Django's synchronous cursor class
        return await psycopg.AsyncConnection.connect(autocommit=True, **params)


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncConnections] = weakref.WeakKeyDictionary()


def async_connections() -> AsyncConnections:
    """The running event loop's connections (a connection belongs to the loop that opened it)."""
    loop = asyncio.get_running_loop()
    if loop not in _by_loop:
        _by_loop[loop] = AsyncConnections()
    return _by_loop[loop]
