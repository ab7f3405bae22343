"""Fixtures for black-box tests that run the whole system as separate processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from django.conf import settings

from arceus.devcluster.cluster import LocalCluster


@pytest.fixture
def e2e_database_url() -> Iterator[str]:
    """A fresh PostgreSQL database of its own, on the server the test settings point at."""
    db = settings.DATABASES["default"]
    assert db["ENGINE"].endswith("postgresql"), "the end-to-end tests run on PostgreSQL: set DATABASE_URL"
    name = f"arceus_e2e_{uuid.uuid4().hex[:8]}"
    host, port, user = db.get("HOST") or "127.0.0.1", db.get("PORT") or 5432, db.get("USER") or "postgres"
    admin = psycopg.connect(host=host, port=port, user=user, password=db.get("PASSWORD") or None,
                            dbname="postgres", autocommit=True)
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgres://{user}@{host}:{port}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture
def e2e_redis_url() -> str:
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def cluster(tmp_path: Path, e2e_database_url: str, e2e_redis_url: str) -> Iterator[LocalCluster]:
    cluster = LocalCluster(workdir=tmp_path, database_url=e2e_database_url, redis_url=e2e_redis_url)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
