"""Nodes' liveness: when each node's agent last heartbeat, and the CPU share its owner's other processes used
then. Kept in Redis, not PostgreSQL: 10,000 agents renew it 1,000 times a second, and a renewal that changes
nothing else must cost no database write (docs/architecture.md, "How the control plane grows").

One sorted set (node id -> renewal time, Unix seconds) that the reconciler reads whole in one call, and one hash
(node id -> host busy fraction). A node absent from the set has not heartbeat since its registration (its
`NodeLease.renewed_at`, written once there, is the floor) or since this Redis began holding leases: after Redis
comes back empty every node gets a whole lease from then on (the `SINCE` key), so losing Redis never makes
live nodes look dead at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from redis.commands.core import Script
from redis.exceptions import NoScriptError

from controlplane.common.redis_client import async_redis_client, redis_client

LEASES = "arceus:node-leases"
BUSY = "arceus:node-busy"
SINCE = "arceus:node-leases-since"
# Entries of nodes silent this long are dropped (a deleted node's too); such a node falls back to its floor.
FORGET_AFTER = timedelta(days=7)


@dataclass(frozen=True)
class Liveness:
    renewed_at: datetime  # the last heartbeat, else the floor (registration, or when Redis came back)
    host_busy_fraction: float | None = None


# One command, not a pipeline of two: a heartbeat's Redis work is most of what a quiet one costs the web server
# (controlplane/agents/heartbeat.py), and redis-py's pipeline machinery cost more than the commands. It renews any
# number of leases (node id, time, busy fraction; "" for none): the web server's event loop renews those of the
# heartbeats it answers together in one.
RENEW = """
for i = 1, #ARGV, 3 do
  redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
  if ARGV[i + 2] == '' then redis.call('HDEL', KEYS[2], ARGV[i])
  else redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2]) end
end
"""


def lease_renew(*, node_id: object, now: datetime, host_busy_fraction: float | None = None) -> None:
    """Record a heartbeat: one round trip, no database."""
    _renew_script()(keys=[LEASES, BUSY], args=_renew_args(node_id, now, host_busy_fraction))


async def leases_renew_async(renewals: list[tuple[object, datetime, float | None]]) -> None:
    """`lease_renew` of each (node id, now, host busy fraction), in one round trip on the running event loop's
    client (the web server's quiet heartbeats)."""
    client = async_redis_client()
    args = [arg for node_id, now, busy in renewals for arg in _renew_args(node_id, now, busy)]
    try:
        await client.evalsha(_renew_script().sha, 2, LEASES, BUSY, *args)
    except NoScriptError:  # a restarted Redis forgets its scripts
        await client.eval(RENEW, 2, LEASES, BUSY, *args)


def _renew_args(node_id: object, now: datetime, host_busy_fraction: float | None) -> list[str]:
    busy = "" if host_busy_fraction is None else repr(float(host_busy_fraction))
    return [str(node_id), repr(now.timestamp()), busy]


@cache
def _renew_script() -> Script:
    return redis_client().register_script(RENEW)


def leases_forget(node_ids: Iterable[object]) -> None:
    """Drop deleted nodes' entries, which every pass would otherwise read until FORGET_AFTER."""
    members = [str(n) for n in node_ids]
    if members:
        pipe = redis_client().pipeline(transaction=False)
        pipe.zrem(LEASES, *members)
        pipe.hdel(BUSY, *members)
        pipe.execute()


@dataclass(frozen=True)
class LeaseScores:
    """The liveness set as one read saw it, as Redis holds it: node id -> last renewal (Unix seconds), node id ->
    host busy fraction, and since when Redis holds leases. Raw, so that a reader keeping views between reads (the
    reconciler's) compares a node's score and builds a `Liveness` only for the nodes whose heartbeat came."""

    renewed: dict[str, float]
    busy: dict[str, float]
    since: datetime

    def liveness(self, node_id: str, floor: datetime) -> Liveness:
        """`node_id`'s liveness, `floor` its registration time (its lease row's `renewed_at`)."""
        score = self.renewed.get(node_id)
        at = datetime.fromtimestamp(score, UTC) if score is not None else max(floor, self.since)
        return Liveness(at, self.busy.get(node_id))


def lease_scores(now: datetime) -> LeaseScores:
    """Every node's liveness entries in two round trips whatever their number; old entries are pruned on the way
    (FORGET_AFTER)."""
    client = redis_client()
    pipe = client.pipeline(transaction=False)
    pipe.zremrangebyscore(LEASES, "-inf", (now - FORGET_AFTER).timestamp())
    pipe.execute_command("ZRANGE", LEASES, 0, -1, "WITHSCORES")  # raw: redis-py's pairs cost 10 ms per 10,000
    pipe.hgetall(BUSY)
    pipe.get(SINCE)
    _, scores, busy, since = pipe.execute()
    if since is None:  # Redis lost its leases (or never held any): everyone's lease starts now
        client.set(SINCE, now.timestamp(), nx=True)
        since = client.get(SINCE)
    return LeaseScores(
        renewed={member.decode(): float(score) for member, score in _pairs(scores)},
        busy={k.decode(): float(v) for k, v in busy.items()},
        since=datetime.fromtimestamp(float(since), UTC),
    )


def leases_read(floors: Mapping[str, datetime], now: datetime) -> dict[str, Liveness]:
    """The liveness of the nodes in `floors` (node id -> registration time), in two round trips whatever their
    number (`lease_scores`)."""
    scores = lease_scores(now)
    return {node_id: scores.liveness(node_id, floor) for node_id, floor in floors.items()}


def _pairs(reply: list[Any]) -> Iterable[tuple[bytes, Any]]:
    """A ZRANGE WITHSCORES reply's (member, score) pairs: nested under RESP3, flat under RESP2."""
    if reply and isinstance(reply[0], list | tuple):
        return reply
    return zip(reply[::2], reply[1::2], strict=True)


def lease_of(node_id: object, floor: datetime) -> Liveness:
    """One node's liveness (the API's and the admin's pages)."""
    key = str(node_id)
    pipe = redis_client().pipeline(transaction=False)
    pipe.zscore(LEASES, key)
    pipe.hget(BUSY, key)
    pipe.get(SINCE)
    score, busy, since = pipe.execute()
    if score is not None:
        at = datetime.fromtimestamp(score, UTC)
    else:
        at = max(floor, datetime.fromtimestamp(float(since), UTC)) if since is not None else floor
    return Liveness(at, float(busy) if busy is not None else None)

