"""The web server's settings, named by every start-up (deploy/Dockerfile, deploy/k8s, devtools/cluster.py):
`gunicorn controlplane.asgi -c python:controlplane.gunicorn_conf`. ARCEUS_WEB_WORKERS sizes it (processes) and
ARCEUS_WEB_THREADS each process's Django threads (controlplane/asgi.py).

Why gunicorn's asyncio worker (`asgi`, on uvloop) and not its gthread worker: nearly every request is a quiet
heartbeat (10,000 agents, 1,000 a second), and under gthread each one paid for the worker's pure-Python request
handling, a hand-off to a thread, and its own database and Redis round trips through synchronous clients. On the
event loop the quiet path (controlplane/nodes/heartbeat.py) needs no thread, and the heartbeats that arrive in
one turn of the loop share one database read and one lease renewal; the rest of the API, the admin and /metrics
are unchanged synchronous Django, run in ARCEUS_WEB_THREADS threads per process (controlplane/asgi.py), so
nothing else had to become async. Measured side by side on this 2-core machine (shared with other work, load
average 6-8; `bench/heartbeat_cost.py --agents 500 --heartbeats 10000`, run on the gthread tree, then on this
one): a quiet heartbeat cost 0.602 ms of web CPU under gthread and costs 0.228 ms here (1,167 vs 2,776 answered
a second); one through Django and DRF 1.98 vs 2.10 ms (the WSGI bridge costs about what gthread's threads did).
Without the shared round trips this worker cost about what gthread did (0.61-0.68 ms: the async psycopg and
redis clients cost what the synchronous ones do), so the sharing is what the event loop buys. gunicorn's C
parser (gunicorn[fast]) made no measurable difference under gthread and is not required. Kept from gthread:
one process per core (the GIL), thousands of idle keep-alive connections per process, persistent database
connections (Django's threads; the quiet path keeps a few async ones of its own), the same command-line shape,
and child_exit for prometheus_client's multiprocess mode.
"""

from __future__ import annotations

import os
from typing import Any

from gunicorn.workers.gasgi import ASGIWorker

from controlplane.common.garbage_collector import garbage_collector_tuned
from controlplane.monitoring.metrics import process_exited

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
    again on gunicorn's socket with asyncio's default backlog, 100 (gunicorn 27.0.1; uvicorn's worker had the
    same bug, encode/uvicorn#544): when 10,000 agents connected, the kernel's accept queue overflowed (42,748
    times in one `bench/control_plane_scale.py` run, `nstat` TcpExtListenOverflows), and a client whose last
    handshake packet was dropped sent its request into a connection the server never accepted, then waited
    out its timeout. `notify` runs first right after the servers start (and every second after): listening
    again there only sets the queue's length."""

    backlog_restored = False

    def notify(self) -> None:
        super().notify()
        if self.servers and not self.backlog_restored:
            for listener in self.sockets:
                listener.sock.listen(self.cfg.backlog)
            self.backlog_restored = True
