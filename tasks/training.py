"""The training queue's tasks: the training driver (one job's pipeline, run to the end under its driver lease)
and sampling text through a job's agents. Only the training worker imports this module (`-I tasks.training`)."""

from __future__ import annotations

from typing import Any

import torch
from celery import signals
from django.conf import settings

from arceus.glibc_malloc import M_ARENA_MAX, tune_malloc
from arceus.relay.dialer import use_relays
from controlplane.celery import SAMPLE_TASK, TRAIN_JOB_TASK, app
from controlplane.common.worker_pool import TRAINING_WORKER_MALLOC_ARENAS
from controlplane.driver.driving import job_drive
from controlplane.jobs.sampler import job_sample_through_agents
from controlplane.nodes.relays import relay_certificate

# The driver and samplers reach relayed agents through these: this worker is the control plane's one that dials
# agents, and the only one that imports this module.
use_relays(settings.ARCEUS_RELAYS, relay_certificate())
# The torch threads a driver computes on (its spot checks' recomputing, reading samples): the worker's drivers are
# threads of one process (controlplane.celery.TRAINING_WORKER_POOL), each on its own, not each with a team of its own.
DRIVER_TORCH_THREADS = 1


@signals.worker_init.connect
def _bound_torch_threads(**_: object) -> None:
    """This worker started: its many drivers never run more torch threads than there are drivers computing."""
    torch.set_num_threads(DRIVER_TORCH_THREADS)


@signals.worker_init.connect
def _cap_malloc_arenas(**_: object) -> None:
    """This worker started, its pool's threads not yet: they share TRAINING_WORKER_MALLOC_ARENAS arenas (glibc fixes
    its limit only once more than 8 arenas exist; before that a new thread's arena obeys this)."""
    tune_malloc(((M_ARENA_MAX, TRAINING_WORKER_MALLOC_ARENAS),), process="training worker")


@app.task(name=TRAIN_JOB_TASK)
def run_job(job_id: str) -> str:
    return job_drive(job_id=job_id)


@app.task(name=SAMPLE_TASK)
def sample(**request: Any) -> dict[str, Any]:
    return job_sample_through_agents(**request)
