"""The web server's settings, named by every start-up (deploy/Dockerfile, deploy/k8s, devtools/cluster.py):
`gunicorn controlplane.wsgi -c python:controlplane.gunicorn_conf`. ARCEUS_WEB_WORKERS / ARCEUS_WEB_THREADS size it.

Why gunicorn's gthread worker and not an ASGI server: every view is synchronous Django (the ORM has no async
path we use), so under uvicorn each request would hop to a thread pool anyway, paying the hop on top. gthread
parks idle keep-alive connections in a selector, not a thread: thousands of agents keep their connections open
between heartbeats (no TCP set-up per beat) while a few threads per process do the work, and a process per core
sidesteps the GIL. A quiet heartbeat is one prepared statement and one Redis command, answered before Django
(controlplane/nodes/heartbeat.py; docs/architecture.md, "How the control plane grows").
"""

from __future__ import annotations

import os
from typing import Any

from controlplane.monitoring.metrics import process_exited

# A thread keeps its database connection between requests (Django's CONN_MAX_AGE, with health checks):
# opening one per heartbeat cost more than the heartbeat. Set before the workers fork and load Django.
os.environ.setdefault("ARCEUS_DB_CONN_MAX_AGE", "60")

worker_class = "gthread"
workers = int(os.environ.get("ARCEUS_WEB_WORKERS", "2"))
threads = int(os.environ.get("ARCEUS_WEB_THREADS", "8"))
worker_connections = 5000  # open (mostly idle keep-alive) connections per process
keepalive = 30  # seconds: above the agents' heartbeat interval, so a heartbeat reuses its connection
timeout = 60


def child_exit(server: Any, worker: Any) -> None:
    """A worker died: its live gauges leave /metrics (prometheus_client's multiprocess mode)."""
    process_exited(worker.pid)
