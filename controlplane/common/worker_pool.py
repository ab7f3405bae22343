"""The training worker's pool, in a module of its own (no Django, no Celery) so that the development cluster
(devtools/cluster.py) starts its worker with the same words as README and deploy/ do (tests/deploy checks them)."""

from __future__ import annotations

# The training worker's drivers are threads of one process: a driver mostly waits for its agents' answers, and a pool
# process per running job held ~230 MiB (docs/BENCHMARKS.md, "Drivers as threads of one worker"). `-c`: how many jobs
# one worker drives at once (a job queued beyond them waits for a free thread or another worker); each running driver
# holds a database connection, and one more renews all their leases (controlplane/driver/lease_renewals.py).
TRAINING_WORKER_POOL = ("-P", "threads", "-c", "32")
# glibc's malloc arenas of the training worker (tasks/training.py sets it as the worker starts): by default each thread
# allocating at once gets one, up to 8 per core, each kept near its high-water mark, so every running driver added an
# arena's worth; its drivers mostly wait on their agents, and two arenas serve them.
TRAINING_WORKER_MALLOC_ARENAS = 2
