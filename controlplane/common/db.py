"""Database helpers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction


@contextmanager
def consistent_snapshot() -> Iterator[None]:
    """A read-only transaction whose queries all see the database as of its first one. Under
    PostgreSQL's default READ COMMITTED each query sees the latest commits, so a response assembled from
    several queries (a job, then its stages) could mix states from before and after a reconcile pass."""
    outermost = not connection.in_atomic_block  # inside another transaction (tests), that one decides
    with transaction.atomic():
        if outermost and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        yield
