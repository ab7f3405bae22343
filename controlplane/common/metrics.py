"""Every Prometheus metric the control plane's processes record, defined once; each instrumented site is one
line that uses one of these.

Multiprocess mode (prometheus_client's): with PROMETHEUS_MULTIPROC_DIR set, every process (gunicorn's
workers, Celery's pool processes) writes its values to files there, and /metrics sums them
(`controlplane.monitoring.collector`). Processes of several containers may share that folder (deploy/compose.yaml),
and pids repeat across containers, so a process's files are named by host and pid. Without the variable
(tests, `runserver`) the values stay in the process. What is read from the database (jobs, nodes, the ledger)
is computed at scrape time instead, so it is right whichever process answers.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram, values
from prometheus_client.multiprocess import mark_process_dead

MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ


HOST = socket.gethostname()  # read once: prometheus_client asks for the identifier at every recorded value


def process_identifier(pid: int | None = None) -> str:
    """Names this process's files (`pid`: another process on this host, for `process_exited`)."""
    return f"{HOST}_{os.getpid() if pid is None else pid}"


if MULTIPROCESS:
    values.ValueClass = values.MultiProcessValue(process_identifier)


def process_exited(pid: int) -> None:
    """gunicorn's child_exit and Celery's worker_process_shutdown: a dead process's live gauges (the drivers it
    ran) leave /metrics."""
    if MULTIPROCESS:
        mark_process_dead(process_identifier(pid))


FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SIZE_BUCKETS = tuple(float(1 << n) for n in range(10, 41, 2))  # 1 KiB .. 1 TiB

RECONCILE_SECONDS = Histogram(
    "arceus_reconcile_duration_seconds", "Wall time of one reconcile pass (read, plan, apply).", buckets=SLOW_BUCKETS
)
RECONCILE_COMPLETED_NAME = "arceus_reconcile_last_completed_timestamp_seconds"  # the lag is derived from it
RECONCILE_COMPLETED = Gauge(
    RECONCILE_COMPLETED_NAME,
    "Unix time the newest reconcile pass completed (the latest of every process's).",
    multiprocess_mode="max",
)
HEARTBEATS = Counter("arceus_heartbeats_total", "Agent heartbeats accepted (each renewed a node's lease).")
HEARTBEATS_TO_DJANGO = Counter(
    "arceus_heartbeats_to_django_total",
    "Heartbeats the quiet path (controlplane/agents/heartbeat.py) handed to Django, by why: 'shape' (a measured "
    "link, an unusual body or header), 'observed' (a stage report that names a stage outside the node's "
    "assignments), 'host' (one ALLOWED_HOSTS refuses), 'token' (no node has it), 'owner' "
    "(disabled), 'unregistered', 'first' (the agent holds no assignments yet, its node hosts stages), 'version' "
    "(its assignments changed) or 'database' (a broken connection, or a batch's Ready transition or stage "
    "reports that deadlocked). Beyond placements, a growing count is a heartbeat path that costs Django's price.",
    ["reason"],
)
HEARTBEAT_SECONDS = Histogram(
    "arceus_heartbeat_handling_seconds", "Wall time the control plane took to handle one agent heartbeat.",
    buckets=FAST_BUCKETS,
)
NODE_READY_TRANSITIONS = Counter(
    "arceus_node_ready_transitions_total",
    "Nodes whose Ready condition changed: to True (heartbeating again) or Unknown (lease expired).",
    ["ready"],
)
DRIVERS_RUNNING = Gauge(
    "arceus_drivers_running", "Training drivers running now (a dead worker's leave with it).",
    multiprocess_mode="livesum",
)
DRIVER_STEP_SECONDS = Histogram(
    "arceus_driver_step_seconds",
    "Wall time of one training step through a job's whole pipeline, as its driver saw it.",
    buckets=SLOW_BUCKETS,
)
DRIVER_FAILURES = Counter(
    "arceus_driver_failures_total",
    "Training drivers that ended without finishing their job: interrupted (a stage failed; the job rewinds), "
    "crashed (a bug; the job fails) or invalid (its configuration; the job fails).",
    ["reason"],
)
LOST_MOVES_HELD = Counter(
    "arceus_lost_moves_held_total",
    "Jobs with a stage on a lost node that a reconcile pass left where they are, counted each pass, by why: "
    "'MovesDeferred' (the pass moved ARCEUS_MAX_MOVES_PER_PASS jobs' lost stages already) or 'NodesDisrupted' (more "
    "than ARCEUS_DISRUPTION_THRESHOLD of the nodes hosting stages are silent at once: no lost stage moves).",
    ["reason"],
)
CHECKPOINT_BYTES = Histogram(
    "arceus_checkpoint_size_bytes", "Bytes of one saved checkpoint (all its stages' files).", buckets=SIZE_BUCKETS
)
CHECKPOINT_SECONDS = Histogram(
    "arceus_checkpoint_save_seconds",
    "Wall time the control plane took to check and store one checkpoint once its stages' files were sent.",
    buckets=SLOW_BUCKETS,
)
CHECKPOINT_BYTES_READ = Counter(
    "arceus_checkpoint_bytes_read_total",
    "Bytes of stage checkpoints read from the checkpoint storage for agents that load them (a rewind, a moved or "
    "rebuilt stage; from an S3 bucket, a file's size as its URL is signed); a replica that joins a running job "
    "copies its peer's state instead and reads none.",
)
for _reason in ("interrupted", "crashed", "invalid"):
    DRIVER_FAILURES.labels(reason=_reason)  # exported at 0 from the start: rate() and increase() see the first one
for _reason in ("MovesDeferred", "NodesDisrupted"):
    LOST_MOVES_HELD.labels(reason=_reason)
for _ready in ("True", "Unknown"):
    NODE_READY_TRANSITIONS.labels(ready=_ready)


@contextmanager
def reconcile_pass() -> Iterator[None]:
    """Times a reconcile pass and, when it completes, records when (the reconcile lag counts from it)."""
    with RECONCILE_SECONDS.time():
        yield
    RECONCILE_COMPLETED.set(time.time())
