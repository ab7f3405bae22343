"""gunicorn's settings for the control plane: `gunicorn controlplane.wsgi -c python:controlplane.gunicorn_conf`."""

from __future__ import annotations

from typing import Any

from controlplane.monitoring.metrics import process_exited


def child_exit(server: Any, worker: Any) -> None:
    """A worker died: its live gauges leave /metrics (prometheus_client's multiprocess mode)."""
    process_exited(worker.pid)
