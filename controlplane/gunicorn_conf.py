"""The web server's settings, named by every start-up (deploy/Dockerfile, deploy/k8s, devtools/cluster.py):
`gunicorn controlplane.asgi -c python:controlplane.gunicorn_conf`. ARCEUS_WEB_WORKERS sizes it (processes) and
ARCEUS_WEB_THREADS each process's Django threads (controlplane/asgi.py).

gunicorn's asyncio worker (on uvloop), not its gthread worker: nearly every request is a quiet heartbeat, which
the event loop answers without a thread (controlplane/agents/heartbeat.py), sharing one database read and one
lease renewal among the heartbeats of one turn of the loop. The rest of the API, the admin and /metrics stay
synchronous Django in ARCEUS_WEB_THREADS threads per process. One process per core (the GIL); thousands of
idle keep-alive connections each. The side-by-side measurement behind the choice is in docs/BENCHMARKS.md
("Why the web server runs gunicorn's asyncio worker").
"""

from __future__ import annotations

import os
from typing import Any

from gunicorn.workers.gasgi import ASGIWorker

from controlplane.common.garbage_collector import garbage_collector_tuned
from controlplane.common.metrics import process_exited

# A thread keeps its database connection between requests (Django's CONN_MAX_AGE, with health checks):
# opening one per heartbeat cost more than the heartbeat. Set before the workers fork and load Django.
os.environ.setdefault("ARCEUS_DB_CONN_MAX_AGE", "60")

worker_class = "controlplane.gunicorn_conf.BackloggedASGIWorker"  # gunicorn's own asyncio worker, as below
asgi_loop = "uvloop"
asgi_lifespan = "off"  # nothing to start or stop: connections open at their first use
workers = int(os.environ.get("ARCEUS_WEB_WORKERS", "2"))
worker_connections = 10000  # open (mostly idle keep-alive) connections per process: agents hold one each
backlog = 2048  # gunicorn's default, said here because the worker below must restore it
keepalive = 30  # seconds: above the agents' heartbeat interval, so a heartbeat reuses its connection
timeout = 60


def post_worker_init(worker: Any) -> None:
    """The garbage collector tuned for an event loop that must not pause (controlplane/common/garbage_collector.py),
    once the worker has loaded Django."""
    garbage_collector_tuned()


def child_exit(server: Any, worker: Any) -> None:
    """A worker died: its live gauges leave /metrics (prometheus_client's multiprocess mode)."""
    process_exited(worker.pid)


class BackloggedASGIWorker(ASGIWorker):
    """gunicorn's asyncio worker, listening with the `backlog` above. Its event loop's create_server listens
    again on gunicorn's socket with asyncio's default backlog, 100 (gunicorn 27.0.1; encode/uvicorn#544 is the
    same bug): with thousands of agents connecting, the accept queue overflowed and clients whose handshake was
    dropped waited out their timeouts. `notify` runs first right after the servers start (and every second
    after): listening again there only sets the queue's length."""

    backlog_restored = False

    def notify(self) -> None:
        super().notify()
        if self.servers and not self.backlog_restored:
            for listener in self.sockets:
                listener.sock.listen(self.cfg.backlog)
            self.backlog_restored = True
