"""The control plane's own Redis connection (REDIS_URL, the broker's server): one pool per process, shared by
its threads (redis-py's client is thread-safe). Holds state that changes too often for PostgreSQL and that the
reconciler can rebuild or wait out when it is lost (nodes' liveness: `controlplane/nodes/liveness.py`)."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings


@cache
def redis_client() -> redis.Redis:
    # Short timeouts: a heartbeat that cannot reach Redis fails fast and the agent retries with backoff.
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5,
                                health_check_interval=30)
