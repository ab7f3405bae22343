"""Fixtures for black-box tests that run the whole system as separate processes.

Starting a cluster (web server, Celery workers and beat, each importing Django and torch) costs more than
most tests' own work on a small machine, so the tests share one (`cluster`): after each passing test its
agents are killed and the control plane's tables are emptied (users and their tokens stay), so the next
test finds what a freshly started cluster holds. After a failed test, or one that left a job that a driver may
still be working on, the cluster is stopped instead and the next test starts a new one. The cluster runs a
redis-server of its own, so the broker-restart test may kill it like any other part.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from selenium import webdriver

from devtools.cluster import LocalCluster
from tests.e2e.browser import chromium

FAILED = pytest.StashKey[bool]()
APP_TABLE_PREFIXES = ("jobs_", "market_", "nodes_", "datasets_")  # the control plane's own apps
# A job in one of these may have a driver at work or a reconcile pass placing it; a merely created one has neither.
UNFINISHED_JOB_STATUSES = ["queued", "placing", "pending", "running"]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    report = yield
    if report.failed:  # type: ignore[attr-defined]
        item.stash[FAILED] = True
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared cluster starts within whichever test first asks for it, so on a loaded machine its start alone
    could spend that test's pytest-timeout. Its start is bounded by its own timeouts (devtools.cluster); a test
    using it keeps its timeout (the suite's, or its own marker's) for the test function alone. The merged marker
    goes first: pytest-timeout reads only the closest one."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            marker = item.get_closest_marker("timeout")
            args, kwargs = (marker.args, marker.kwargs) if marker else ((), {})
            item.add_marker(pytest.mark.timeout(*args, **{**kwargs, "func_only": True}), append=False)


def connect(database: str) -> psycopg.Connection:
    """An autocommit connection to `database` on the server the test settings point at."""
    db = settings.DATABASES["default"]
    assert db["ENGINE"].endswith("postgresql"), "the end-to-end tests run on PostgreSQL: set DATABASE_URL"
    return psycopg.connect(host=db.get("HOST") or "127.0.0.1", port=db.get("PORT") or 5432,
                           user=db.get("USER") or "postgres", password=db.get("PASSWORD") or None,
                           dbname=database, autocommit=True)


@contextmanager
def fresh_database() -> Iterator[str]:
    """A new PostgreSQL database of its own; its URL."""
    db = settings.DATABASES["default"]
    name = f"arceus_e2e_{uuid.uuid4().hex[:8]}"
    host, port, user = db.get("HOST") or "127.0.0.1", db.get("PORT") or 5432, db.get("USER") or "postgres"
    with connect("postgres") as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgres://{user}@{host}:{port}/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def started_cluster(workdir: Path) -> Iterator[LocalCluster]:
    """A running cluster on a fresh database and a redis-server of its own."""
    with fresh_database() as database_url:
        # Heartbeats and reconcile passes every second, not every 2 s: placements reach agents and lost nodes
        # are noticed sooner. A node still counts as lost only after the default 6 s of silence.
        # Two relays, for agents in network namespaces that cannot be dialled (tests/e2e/test_relayed_agents.py).
        # Compute is priced at $3600/h: the few ms a test job computes are worth whole micro-dollars (at the
        # usual $0.30/h less than one, and credit, fees and withheld credit would all round to 0).
        # The cluster's one user mints every test's nodes within the hour: more than a contributor's 30/hour.
        cluster = LocalCluster(workdir=workdir, database_url=database_url, redis_url=None,
                               heartbeat_interval_seconds=1.0, reconcile_interval_seconds=1.0, relays=2,
                               extra_env={"ARCEUS_BASELINE_PRICE_PER_HOUR": "3600",
                                          "ARCEUS_THROTTLE_NODE_CREATE": "1000/hour"})
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


class SharedCluster:
    """One cluster lent to test after test; `get()` starts one when none runs."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._stack = ExitStack()
        self._cluster: LocalCluster | None = None

    def get(self) -> LocalCluster:
        if self._cluster is None:
            self._cluster = self._stack.enter_context(started_cluster(self._tmp_path_factory.mktemp("cluster")))
        return self._cluster

    def stop(self) -> None:
        self._cluster = None
        self._stack.close()

    def reset(self) -> None:
        """Kill the last test's agents and empty the control plane's tables; or stop the cluster if a job is
        unfinished (its driver may still be at work)."""
        cluster = self.get()
        cluster.kill_agents()
        # Idle keep-alive connections go too: the web server may close one just as the next test reuses it.
        cluster.client.session.close()
        cluster.supervisor.check_alive()  # a part that died under a passing test is a failure of its own
        with connect(str(cluster.database_url).rsplit("/", 1)[1]) as db:
            db.execute("SET lock_timeout = '10s'")  # a lock some process holds on: an error, not a hung suite
            [unfinished] = db.execute("SELECT count(*) FROM jobs_job WHERE status = ANY(%s)",
                                      [UNFINISHED_JOB_STATUSES]).fetchone() or [0]
            if not unfinished:
                tables = [name for (name,) in db.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
                          if name.startswith(APP_TABLE_PREFIXES)]
                truncate = "TRUNCATE {} RESTART IDENTITY CASCADE".format(", ".join(f'"{t}"' for t in tables))
                # The workers and beat still write (reconcile passes, ledger roll-ups): PostgreSQL may pick the
                # TRUNCATE, which locks every table, as a deadlock's victim; the next try finds them done.
                for attempt in range(3):
                    try:
                        db.execute(truncate)
                        break
                    except psycopg.errors.DeadlockDetected:
                        if attempt == 2:
                            raise
        if unfinished:
            self.stop()


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedCluster]:
    shared = SharedCluster(tmp_path_factory)
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
def cluster(shared_cluster: SharedCluster, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """The shared cluster, as a freshly started one is: every part running, no nodes, no jobs."""
    yield shared_cluster.get()
    if request.node.stash.get(FAILED, False):
        shared_cluster.stop()
        return
    try:
        shared_cluster.reset()
    except BaseException:
        shared_cluster.stop()
        raise


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """A headless chromium of this test's (tests/e2e/browser.py)."""
    with chromium(tmp_path / "chromium") as driver:
        yield driver
