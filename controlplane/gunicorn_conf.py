"""The web server's settings, named by every start-up (deploy/Dockerfile, deploy/k8s, devtools/cluster.py):
`gunicorn controlplane.asgi -c python:controlplane.gunicorn_conf`. ARCEUS_WEB_WORKERS sizes it (processes) and
ARCEUS_WEB_THREADS each process's Django threads (controlplane/asgi.py).

TODO: the measured case for the asgi worker.
"""

from __future__ import annotations

import os
from typing import Any

from controlplane.monitoring.metrics import process_exited

# A thread keeps its database connection between requests (Django's CONN_MAX_AGE, with health checks):
# opening one per heartbeat cost more than the heartbeat. Set before the workers fork and load Django.
os.environ.setdefault("ARCEUS_DB_CONN_MAX_AGE", "60")

worker_class = "asgi"  # gunicorn's own asyncio worker
asgi_loop = "uvloop"
asgi_lifespan = "off"  # nothing to start or stop: connections open at their first use
workers = int(os.environ.get("ARCEUS_WEB_WORKERS", "2"))
worker_connections = 5000  # open (mostly idle keep-alive) connections per process
keepalive = 30  # seconds: above the agents' heartbeat interval, so a heartbeat reuses its connection
timeout = 60


def child_exit(server: Any, worker: Any) -> None:
    """A worker died: its live gauges leave /metrics (prometheus_client's multiprocess mode)."""
    process_exited(worker.pid)
