"""The Celery app "arceus": `celery -A controlplane.celery worker -Q control` (or
`-Q training,sampling -I tasks.training -P threads -c 32`, its pool in controlplane/common/worker_pool.py, or
`-Q reachability -I tasks.nodes`), and `celery -A controlplane.celery beat`. Its task modules (`tasks/`) are named
here, not imported: the control plane never imports them, it enqueues tasks by name (`controlplane.common.dispatch`).

Environment-driven values (broker and result backend = REDIS_URL, the resync interval) come from the
Django settings; the delivery guarantees and the routing below are part of the design, so they are
fixed here rather than configurable.
"""

from __future__ import annotations

import os
import sys

from celery import Celery, signals
from django.conf import settings
from kombu import Queue

from controlplane.common.garbage_collector import garbage_collector_tuned

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

# Task names: the task modules register them, the routes below and the control plane's enqueueing
# (controlplane.common.dispatch) use them; by name, so the control plane never imports a task module.
RECONCILE_TASK = "arceus.reconcile"
REPRICE_TASK = "arceus.reprice"
ROLLUP_LEDGER_TASK = "arceus.rollup_ledger"
TRAIN_JOB_TASK = "arceus.train_job"
SAMPLE_TASK = "arceus.sample"
ESTIMATE_TASK = "arceus.estimate"
CHECK_REACHABILITY_TASK = "arceus.check_reachability"

CONTROL_QUEUE = "control"  # short reconcile passes, and estimates (each bounded by ARCEUS_SOLVER_SECONDS)
TRAINING_QUEUE = "training"  # long-running training drivers, kept apart so they never delay reconciles
# Text sampled through a job's agents, by the training worker (it loads torch and dials agents too), in a queue of
# its own so that a request waiting for it never waits behind queued training drivers.
SAMPLING_QUEUE = "sampling"
# Dial-backs after registrations: a sweep waits out the timeout of every agent behind a router, kept apart so a
# burst of registrations never delays reconciles (controlplane/nodes/reachability.py).
REACHABILITY_QUEUE = "reachability"

# Every worker's task modules. The training tasks (the driver) and the reachability sweep (dial-backs) load
# gRPC, the driver torch too: only the training worker imports tasks.training, and only the reachability worker
# tasks.nodes (`-I` on their command lines), so the control worker (and the web server) load neither.
# The list is a constant of its own: a started worker adds its `-I` modules to `app.conf.include`.
WORKER_TASK_MODULES = ("tasks.control", "tasks.estimates", "tasks.market")
app = Celery("arceus", include=list(WORKER_TASK_MODULES))
# The task modules that only the worker of a queue imports: what its `-I` names.
QUEUE_TASK_MODULES = {"training": "tasks.training", "sampling": "tasks.training", "reachability": "tasks.nodes"}
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    # A task is acknowledged only after it ran, and one a dying worker held goes back to the queue;
    # tasks are idempotent, so running one twice is safe, losing one is not.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # A worker reserves one task at a time: a training driver can run for minutes and must not sit on
    # messages another worker could take.
    worker_prefetch_multiplier=1,
    task_queues=(Queue(CONTROL_QUEUE), Queue(TRAINING_QUEUE), Queue(SAMPLING_QUEUE), Queue(REACHABILITY_QUEUE)),
    task_default_queue=CONTROL_QUEUE,
    task_routes={
        RECONCILE_TASK: {"queue": CONTROL_QUEUE},
        REPRICE_TASK: {"queue": CONTROL_QUEUE},
        ROLLUP_LEDGER_TASK: {"queue": CONTROL_QUEUE},
        ESTIMATE_TASK: {"queue": CONTROL_QUEUE},
        CHECK_REACHABILITY_TASK: {"queue": REACHABILITY_QUEUE},
        TRAIN_JOB_TASK: {"queue": TRAINING_QUEUE},
        SAMPLE_TASK: {"queue": SAMPLING_QUEUE},
    },
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    beat_schedule={
        # The level-triggered resync: everything is recomputed from the database each pass.
        "reconcile": {
            "task": RECONCILE_TASK,
            "schedule": settings.ARCEUS_RECONCILE_INTERVAL_SECONDS,
            # A pass that waited longer than a few intervals is stale; a newer one is on its way.
            "options": {"expires": 5 * settings.ARCEUS_RECONCILE_INTERVAL_SECONDS},
        },
        # Any node whose dial-back was lost (its message expired, its worker died) is dialled by the next sweep.
        "check-reachability": {
            "task": CHECK_REACHABILITY_TASK,
            "schedule": settings.ARCEUS_REACHABILITY_SWEEP_SECONDS,
            "options": {"expires": settings.ARCEUS_REACHABILITY_SWEEP_SECONDS},
        },
        "reprice": {
            "task": REPRICE_TASK,
            "schedule": settings.ARCEUS_REPRICE_INTERVAL_SECONDS,
            "options": {"expires": settings.ARCEUS_REPRICE_INTERVAL_SECONDS},
        },
        "rollup-ledger": {
            "task": ROLLUP_LEDGER_TASK,
            "schedule": settings.ARCEUS_LEDGER_ROLLUP_INTERVAL_SECONDS,
            "options": {"expires": settings.ARCEUS_LEDGER_ROLLUP_INTERVAL_SECONDS},
        },
    },
)


@signals.worker_init.connect
@signals.worker_process_init.connect
def _tune_collector(**_: object) -> None:
    """A worker (whose pool threads run its tasks: the training worker's) or a pool process has started, its tasks
    loaded: a reconcile pass over 10,000 nodes must not stop for a full collection of the worker's heap
    (controlplane/common/garbage_collector.py)."""
    garbage_collector_tuned()


@signals.worker_process_shutdown.connect
def _drop_live_metrics(pid: int, **_: object) -> None:
    """A pool process is ending: its live gauges leave /metrics (prometheus_client's multiprocess mode)."""
    from controlplane.common.metrics import process_exited

    process_exited(pid)


@signals.worker_shutdown.connect
def _drop_own_live_metrics(**_: object) -> None:
    """A worker is ending: the live gauges of the tasks its own threads ran (the training worker's drivers) leave
    /metrics with it."""
    _drop_live_metrics(os.getpid())


@signals.worker_init.connect
@signals.beat_init.connect
def _refuse_development_secret(**_: object) -> None:
    """A worker or beat never serves on the public development key (controlplane.common.startup). Celery logs
    and ignores a receiver's exception, so the refusal exits the process."""
    import django
    from django.core.exceptions import ImproperlyConfigured

    django.setup()
    from controlplane.common.startup import refuse_development_secret

    try:
        refuse_development_secret()
    except ImproperlyConfigured as exc:
        print(f"arceus: {exc}", file=sys.__stderr__, flush=True)  # the real stderr: Celery redirects sys.stderr
        raise SystemExit(1) from None
