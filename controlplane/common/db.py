"""Database helpers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import Model

log = logging.getLogger(__name__)
R = TypeVar("R")


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


def row_versions_reliable() -> bool:
    """Whether PostgreSQL's `xmin` tells a row's committed versions apart for a read starting now: every transaction
    that writes a row gives it a new one, but two writes in one transaction share it, so not while the caller holds a
    transaction open (a test's, which the reader would see its own uncommitted writes through), and not on SQLite."""
    return connection.vendor == "postgresql" and not connection.in_atomic_block


def reconnecting(call: Callable[[], R], *, what: str, for_seconds: float) -> R:
    """`call()`, retried with a fresh connection while the database is out of reach (a restart, a failover):
    a long-lived process (a training driver) outside any request would otherwise keep its dead connection and
    fail every query after. `call` must be one whole transaction (it committed or it did not); it is retried
    only for `for_seconds`, then the error is raised."""
    if connection.in_atomic_block:
        return call()  # inside the caller's transaction: a lost connection loses that too; it decides
    deadline, delay = time.monotonic() + for_seconds, 0.25
    while True:
        try:
            return call()
        except (OperationalError, InterfaceError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s: the database connection failed (%s); reconnecting in %.2f s", what, exc, delay)
            connection.close()
            time.sleep(delay)
            delay = min(2 * delay, 4.0)


def rows_update(model: type[Model], rows: Sequence[Model], fields: Sequence[str], *, batch: int = 1000) -> None:
    """Write `fields` of each of `rows` (instances of `model`, by primary key), `batch` rows a statement: on PostgreSQL
    an UPDATE from a VALUES list, as Django's `bulk_update` builds a CASE per field and row, whose compiling took more
    CPU than the rest of recording a batch of running jobs' progress; elsewhere `bulk_update`."""
    if not rows:
        return
    if connection.vendor != "postgresql":
        model._default_manager.bulk_update(rows, fields, batch_size=batch)
        return
    meta, quote = model._meta, connection.ops.quote_name
    columns = [meta.pk, *(meta.get_field(name) for name in fields)]
    values = "(" + ", ".join(f"%s::{column.db_type(connection)}" for column in columns) + ")"
    names = [quote(column.column) for column in columns]
    table, key = quote(meta.db_table), names[0]
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        sql = (
            f"UPDATE {table} SET {', '.join(f'{name} = v.{name}' for name in names[1:])} "  # noqa: S608 (quoted names)
            f"FROM (VALUES {', '.join([values] * len(chunk))}) AS v ({', '.join(names)}) "
            f"WHERE {table}.{key} = v.{key}"
        )
        params = [
            column.get_db_prep_save(getattr(row, column.attname), connection) for row in chunk for column in columns
        ]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
