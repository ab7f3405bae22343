"""The Celery configuration the design depends on."""

from __future__ import annotations

import importlib

from django.conf import settings

from controlplane.celery import QUEUE_TASK_MODULES, WORKER_TASK_MODULES, app


def test_delivery_guarantees() -> None:
    assert app.main == "arceus"
    assert app.conf.task_acks_late is True
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.broker_connection_retry_on_startup is True


def test_broker_and_results_use_redis_url() -> None:
    assert app.conf.broker_url == settings.REDIS_URL
    assert app.conf.result_backend == settings.REDIS_URL


def test_tasks_are_registered_by_name_and_routed_to_their_queue() -> None:
    app.loader.import_default_modules()
    assert {"arceus.reconcile", "arceus.estimate"} <= set(app.tasks)
    # The training and reachability workers' own modules (their `-I`), which load torch or gRPC.
    assert not set(QUEUE_TASK_MODULES.values()) & set(WORKER_TASK_MODULES)
    for module in QUEUE_TASK_MODULES.values():
        importlib.import_module(module)
    assert {"arceus.train_job", "arceus.check_reachability"} <= set(app.tasks)
    assert {q.name for q in app.conf.task_queues} == {"control", "reachability", "training", "sampling"}
    router = app.amqp.router
    assert router.route({}, "arceus.reconcile")["queue"].name == "control"
    assert router.route({}, "arceus.train_job")["queue"].name == "training"
    assert router.route({}, "arceus.sample")["queue"].name == "sampling"
    assert router.route({}, "arceus.estimate")["queue"].name == "control"  # bounded by ARCEUS_SOLVER_SECONDS


def test_beat_resyncs_every_reconcile_interval() -> None:
    entry = app.conf.beat_schedule["reconcile"]
    assert entry["task"] == "arceus.reconcile"
    assert entry["schedule"] == settings.ARCEUS_RECONCILE_INTERVAL_SECONDS == 2
