"""The control plane's own Redis connection (REDIS_URL, the broker's server): one pool per process, shared by
its threads (redis-py's client is thread-safe), and one per event loop for what the web server's event loop does
itself (the quiet heartbeat's lease: controlplane/agents/heartbeat.py). Holds state that changes too often for
PostgreSQL and that the reconciler can rebuild or wait out when it is lost (nodes' liveness:
`controlplane/nodes/liveness.py`)."""

from __future__ import annotations

import asyncio
import weakref
from functools import cache

import redis
import redis.asyncio
from django.conf import settings

# Short timeouts: a heartbeat that cannot reach Redis fails fast and the agent retries with backoff.
OPTIONS = {"socket_timeout": 5, "socket_connect_timeout": 5, "health_check_interval": 30}

_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, redis.asyncio.Redis] = weakref.WeakKeyDictionary()


@cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, **OPTIONS)


def async_redis_client() -> redis.asyncio.Redis:
    """The running event loop's client (its connections belong to that loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _by_loop:
        _by_loop[loop] = redis.asyncio.Redis.from_url(settings.REDIS_URL, **OPTIONS)
    return _by_loop[loop]
