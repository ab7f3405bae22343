"""Fixtures shared across the test tree, and a Redis database of its own for each pytest-xdist worker."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import torch
from django.conf import settings
from django.db.backends.postgresql.operations import DatabaseOperations
from hypothesis import settings as hypothesis_settings

from devtools.agent_wheel import InstalledAgent, install_agent
from nodeagent.agent import Agent

REDIS_DATABASES = 16  # a Redis server's default number of databases
# Files whose tests each run a whole system for a minute or more (clusters of processes, the wheel's install).
WHOLE_SYSTEM_FILES = ("tests/e2e/", "tests/test_packaging.py")

# Hashing a password is slow by design (PBKDF2, about half a second on a busy core) and the tests hash hundreds: the
# test process uses Django's fast hasher. Clusters started as processes (tests/e2e) hash with the shipped settings.
TEST_PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


# Hypothesis' per-example deadline (200 ms) is a timing assertion: on a loaded machine it failed property tests of
# pure functions that were right. The properties are the assertions; how long an example takes is not one.
hypothesis_settings.register_profile("arceus", deadline=None)
hypothesis_settings.load_profile("arceus")


def pytest_configure(config: pytest.Config) -> None:
    settings.PASSWORD_HASHERS = TEST_PASSWORD_HASHERS
    _worker_redis_database()
    _worker_threads()
    _flush_by_delete()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """Collection imports every test module and all they import (~600,000 objects the collector tracks), which live as
    long as the session: the cycle collector waits until they are all created, then leaves them out of its view
    (`gc.freeze`, as controlplane/common/garbage_collector.py does for a server's code). Otherwise every later full
    collection scans them again, the one an agent's dropped stage runs (nodeagent.hosting) too: docs/BENCHMARKS.md."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


@pytest.hookimpl(trylast=True)  # after `-m` deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadfile --no-loadscope-reorder` (the slow part of `make test`), xdist hands out whole files in
    the order collected, each to the next worker that runs short of work. The whole-system files go first, those
    with the most tests first, then the rest as collected (the training parity files, then the agent's shorter
    ones): both workers run out of work within seconds of each other, not one still running a long file that was
    handed out last. The workers collect, and pytest-xdist sets their `dist` option to "no": the command line's
    value is read."""
    if getattr(config.known_args_namespace, "dist", None) != "loadfile":
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path.relative_to(config.rootpath).as_posix(), []).append(item)

    def whole_system_first(entry: tuple[str, list[pytest.Item]]) -> tuple[bool, int]:
        path, in_file = entry
        return (False, -len(in_file)) if path.startswith(WHOLE_SYSTEM_FILES) else (True, 0)

    items[:] = [item for _, in_file in sorted(files.items(), key=whole_system_first) for item in in_file]


def _worker_threads() -> None:
    """Under pytest-xdist the workers share the machine's cores: each computes with its share. torch's default is
    every core, so two workers on two cores ran four threads whose OpenMP waits spin on a core another one needs:
    beside one busy process, the 60 Adam steps of a tiny GPT (tests/arceus/model/test_gpt_generate.py) took 7 s on
    two threads and 1.6-2.5 s on one."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None:
        torch.set_num_threads(max(1, torch.get_num_threads() // int(workers)))


def _flush_by_delete() -> None:
    """After each transactional test Django empties every table with one TRUNCATE, which PostgreSQL carries out file
    by file (new files for each table and index, its buffers dropped): 0.6-0.8 s for our ~30 nearly empty tables,
    where DELETE takes milliseconds. The tests' flushes delete instead, in one transaction: every foreign key Django
    creates is checked at commit (DEFERRABLE INITIALLY DEFERRED), so the order does not matter. A flush that resets
    sequences still truncates."""
    truncate = DatabaseOperations.sql_flush

    def sql_flush(self: DatabaseOperations, style: Any, tables: list[str], *, reset_sequences: bool = False,
                  allow_cascade: bool = False) -> list[str]:
        if reset_sequences:
            return truncate(self, style, tables, reset_sequences=True, allow_cascade=allow_cascade)
        return [f"{style.SQL_KEYWORD('DELETE FROM')} {style.SQL_FIELD(self.quote_name(table))};" for table in tables]

    DatabaseOperations.sql_flush = sql_flush


def _worker_redis_database() -> None:
    """Under pytest-xdist (`-n N`), worker gwI uses REDIS_URL's database + I (settings and the environment its
    children inherit): pytest-django gives each worker a test database of its own, but the nodes' leases
    (controlplane/nodes/liveness.py) live under fixed Redis keys that one worker's test empties while another's
    relies on them. Runs before any test reads the settings or Celery's configuration."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    base = urlsplit(settings.REDIS_URL)
    first, workers = int(base.path.strip("/") or 0), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    if first + workers > REDIS_DATABASES:
        raise pytest.UsageError(
            f"REDIS_URL {settings.REDIS_URL} names database {first}: {workers} xdist workers would use {first} to "
            f"{first + workers - 1}, beyond Redis's {REDIS_DATABASES}; name one at most {REDIS_DATABASES - workers}")
    url = urlunsplit(base._replace(path=f"/{first + int(worker.removeprefix('gw'))}"))
    settings.REDIS_URL = settings.CELERY_BROKER_URL = settings.CELERY_RESULT_BACKEND = os.environ["REDIS_URL"] = url


@pytest.fixture
def agent() -> Iterator[Agent]:
    """A node agent started in this process on CPU (its gRPC server on a free port), stopped afterwards."""
    started = Agent(device=torch.device("cpu"))
    started.start()
    try:
        yield started
    finally:
        started.stop(grace=1)


@pytest.fixture(scope="session")
def installed_agent(tmp_path_factory: pytest.TempPathFactory) -> InstalledAgent:
    """The agent as a contributor installs it (devtools.agent_wheel), built once per session."""
    return install_agent(tmp_path_factory.mktemp("agent-wheel"))
