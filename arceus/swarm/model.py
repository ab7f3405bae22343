"""A pure performance model of one synchronous step of a replicated pipeline, for placement (is one more
replica worth its price?), estimates and the swarm's simulations.

It replays the step as the agents run it: the routes by speed (arceus.swarm.routing), each replica's list
(arceus.pipeline.schedule.replica_schedule), each boundary tensor sent when computed, then each stage's
exchange (reduce-scatter, all-gather). Every tensor a replica sends leaves through its uplink, whose timing
is the shaper's rule (arceus.swarm.link.LinkPlan): serialised by a token bucket at the link's rate, then
delayed by its latency. What a replica receives is not limited; the driver's inputs and labels are there
when the step starts, and the optimizer's step is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from arceus.pipeline.schedule import SCHEDULES, replica_schedule
from arceus.swarm.link import LinkPlan
from arceus.swarm.routing import route_step


@dataclass(frozen=True)
class Link:
    """A device's uplink: one-way latency and rate; `per_peer`: each peer it sends to is reached over a link of
    its own of that rate (as the bench's shaper shapes each connection apart), not all through one uplink."""

    latency_s: float
    bandwidth_bps: float
    per_peer: bool = False

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bps <= 0:
            raise ValueError(f"a link needs latency_s >= 0 and bandwidth_bps > 0, got {self}")


@dataclass(frozen=True)
class Replica:
    """A device as a replica of a stage: its compute seconds per sample of the stage (forward and backward)
    and its uplink."""

    seconds_per_sample: float
    uplink: Link

    def __post_init__(self) -> None:
        if not self.seconds_per_sample > 0:
            raise ValueError(f"seconds_per_sample must be > 0, got {self.seconds_per_sample}")


@dataclass(frozen=True)
class Workload:
    """What a step moves: `batch_size` samples in `micro_batches`; `boundary_bytes_per_sample[i]` between
    stage i and i + 1 (the activation forward, its gradient back); `gradient_bytes[i]`: what stage i's
    exchange reduces (as sent: after the job's transfer compression); `forward_share`: of a sample's compute,
    the forward's (a backward costs about two forwards); `sync_every`: the replicas exchange every this many
    steps (replica_sync's H: DiLoCo's weight deltas are as many bytes as the gradients; 1: every step, exact)."""

    micro_batches: int
    batch_size: int
    boundary_bytes_per_sample: tuple[float, ...]
    gradient_bytes: tuple[float, ...]
    schedule: str = "1f1b"
    forward_share: float = 1 / 3
    sync_every: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundary_bytes_per_sample", tuple(self.boundary_bytes_per_sample))
        object.__setattr__(self, "gradient_bytes", tuple(self.gradient_bytes))
        if not 1 <= self.micro_batches <= self.batch_size:
            raise ValueError(f"need 1 <= micro_batches <= batch_size, got {self.micro_batches}, {self.batch_size}")
        if len(self.boundary_bytes_per_sample) != len(self.gradient_bytes) - 1:
            raise ValueError("boundary_bytes_per_sample needs one entry per boundary: len(gradient_bytes) - 1")
        if any(b < 0 for b in (*self.boundary_bytes_per_sample, *self.gradient_bytes)):
            raise ValueError("byte counts must be >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        if not 0 < self.forward_share < 1:
            raise ValueError(f"forward_share must be in (0, 1), got {self.forward_share}")
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1, got {self.sync_every!r}")


@dataclass(frozen=True)
class StepTime:
    """seconds: the step, until every stage's reduced gradient is everywhere; pipeline_seconds: until the
    last backward; exchange_seconds[i]: stage i's exchange, from its last backward; micro_batches[i][k]:
    how many micro-batches replica k of stage i took."""

    seconds: float
    pipeline_seconds: float
    exchange_seconds: tuple[float, ...]
    micro_batches: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ReplicaGain:
    """Samples per second without and with one more replica at a stage."""

    before: float
    after: float

    @property
    def gain(self) -> float:
        return self.after - self.before


class _Uplinks:
    """The replicas' links as the shaper's rule times them (LinkPlan): one uplink a replica sends everything
    through, or one per peer (`Link.per_peer`)."""

    def __init__(self, replicas: dict[tuple[int, int], Replica]) -> None:
        self._replicas = replicas
        self._plans: dict[object, LinkPlan] = {}

    def arrival(self, source: tuple[int, int], to: tuple[int, int], now: float, nbytes: float) -> float:
        """When `nbytes` that `source` hands its link to `to` at `now` have arrived."""
        link = self._replicas[source].uplink
        key = (source, to) if link.per_peer else source
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = LinkPlan(link.latency_s, link.bandwidth_bps)
        return plan.arrival(now, nbytes)

    def spread(self, source: tuple[int, int], peers: Sequence[tuple[int, int]], now: float, nbytes: float) -> float:
        """When `nbytes` handed at `now` in equal parts to `peers` (an exchange phase) have all arrived."""
        if not peers:
            return now
        return max(self.arrival(source, to, now, nbytes / len(peers)) for to in peers)


def step_time(stages: Sequence[Sequence[Replica]], workload: Workload) -> StepTime:
    """The predicted time of one step of `workload` on these replicas (stage i's are `stages[i]`)."""
    return _step_time(tuple(tuple(s) for s in stages), workload)


def mean_step_seconds(stages: Sequence[Sequence[Replica]], workload: Workload) -> float:
    """A step's mean time: every step's pipeline, and the exchange every `sync_every` steps (step_time is a step
    that exchanges; the others end at their last backward)."""
    exchanging = step_time(stages, workload).seconds
    if workload.sync_every == 1:
        return exchanging
    local = step_time(stages, replace(workload, gradient_bytes=(0.0,) * len(workload.gradient_bytes))).seconds
    return (exchanging + (workload.sync_every - 1) * local) / workload.sync_every


def samples_per_second(stages: Sequence[Sequence[Replica]], workload: Workload) -> float:
    """The predicted training throughput."""
    return workload.batch_size / mean_step_seconds(stages, workload)


def replica_gain(
    stages: Sequence[Sequence[Replica]], workload: Workload, stage: int, replica: Replica
) -> ReplicaGain:
    """What one more replica at `stage` would do to samples/s: more compute for its share of micro-batches,
    more exchange bytes (2(R-1)/R of the gradient per replica). Placement adds it when the gain is worth
    its price; a stage cannot have more replicas than micro-batches."""
    if not 0 <= stage < len(stages):
        raise ValueError(f"stage must be in [0, {len(stages)}), got {stage}")
    if len(stages[stage]) >= workload.micro_batches:
        raise ValueError(
            f"stage {stage} already has {len(stages[stage])} replicas for {workload.micro_batches} micro-batches"
        )
    grown = [list(s) for s in stages]
    grown[stage].append(replica)
    return ReplicaGain(samples_per_second(stages, workload), samples_per_second(grown, workload))


@lru_cache(maxsize=4096)
def _step_time(stages: tuple[tuple[Replica, ...], ...], w: Workload) -> StepTime:
    n = len(stages)
    if n != len(w.gradient_bytes) or any(not s for s in stages):
        raise ValueError(f"{n} stages, each with replicas, for a workload of {len(w.gradient_bytes)} stages")
    replicas = {(i, k): r for i, s in enumerate(stages) for k, r in enumerate(s)}
    speeds = {key: 1 / r.seconds_per_sample for key, r in replicas.items()}
    routes = route_step(w.micro_batches, [list(range(len(s))) for s in stages], speeds)
    size, extra = divmod(w.batch_size, w.micro_batches)
    samples = [size + (1 if m < extra else 0) for m in range(w.micro_batches)]  # torch.tensor_split's sizes
    uplink = _Uplinks(replicas)
    deepest = max(len(s) for s in stages)
    todo = {
        (i, k): replica_schedule(w.schedule, n, i, routes.micro_batches_of(i, k), replicas=deepest) for i, k in replicas
    }
    free = dict.fromkeys(replicas, 0.0)
    activation = {(0, m): 0.0 for m in range(w.micro_batches)}  # (stage, micro-batch) -> input there
    # (stage, micro-batch) -> its output's gradient there; the last stage's follows its own forward (the loss)
    gradient = {(n - 1, m): 0.0 for m in range(w.micro_batches)}
    while any(todo.values()):
        progressed = False
        for (i, k), actions in todo.items():
            while actions:
                forward, m = actions[0].kind == "F", actions[0].micro_batch
                ready = (activation if forward else gradient).get((i, m))
                if ready is None:
                    break
                share = w.forward_share if forward else 1 - w.forward_share
                end = free[(i, k)] = max(free[(i, k)], ready) + replicas[(i, k)].seconds_per_sample * samples[m] * share
                if forward and i < n - 1:
                    activation[(i + 1, m)] = uplink.arrival(
                        (i, k), (i + 1, routes.of[m][i + 1]), end, w.boundary_bytes_per_sample[i] * samples[m])
                elif not forward and i > 0:
                    gradient[(i - 1, m)] = uplink.arrival(
                        (i, k), (i - 1, routes.of[m][i - 1]), end, w.boundary_bytes_per_sample[i - 1] * samples[m])
                actions.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("the replicas' schedules deadlocked")  # replica_schedule proves they cannot
    pipeline = max(free.values())
    exchange = []
    for i, stage in enumerate(stages):
        done = max(free[(i, k)] for k in range(len(stage)))
        per_replica = (len(stage) - 1) / len(stage) * w.gradient_bytes[i]  # each phase, each replica
        end = done
        if per_replica > 0:
            for _ in ("reduce-scatter", "all-gather"):
                end = max(uplink.spread((i, k), [(i, j) for j in range(len(stage)) if j != k], end, per_replica)
                          for k in range(len(stage)))
        exchange.append(end - done)
    counts = tuple(tuple(len(routes.micro_batches_of(i, k)) for k in range(len(s))) for i, s in enumerate(stages))
    seconds = max(max(free[(i, k)] for k in range(len(s))) + exchange[i] for i, s in enumerate(stages))
    return StepTime(seconds, pipeline, tuple(exchange), counts)


@dataclass(frozen=True)
class SharedHost:
    """Every replica on one host (a bench machine): `cores` cores shared by all of them (fewer than it has where
    other work takes some: a fraction counts); `replica_overhead_s`: each replica's CPU seconds per step beyond its
    compute and its exchange (its RunStep, its optimizer step, which every replica runs in full);
    `exchange_cpu_per_byte`: CPU seconds per byte a replica sends or receives in its stage's exchange (building,
    encrypting, decrypting and parsing the shards, summing them); `other_cpu_s`: CPU seconds per step of what else
    runs there (the driver, a link shaper)."""

    cores: float
    replica_overhead_s: float = 0.0
    other_cpu_s: float = 0.0
    exchange_cpu_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if not self.cores > 0 or min(self.replica_overhead_s, self.other_cpu_s, self.exchange_cpu_per_byte) < 0:
            raise ValueError(f"a host needs cores > 0 and overheads >= 0, got {self}")


def exchange_bytes_per_replica(stages: Sequence[Sequence[Replica]], workload: Workload) -> tuple[float, ...]:
    """What each replica of stage i sends (and as much it receives) in one exchange: 2 (R - 1) / R of the
    stage's gradient bytes, over reduce-scatter and all-gather; 0 for a stage of one replica."""
    return tuple(2 * (len(s) - 1) / len(s) * g for s, g in zip(stages, workload.gradient_bytes, strict=True))


def cpu_seconds_per_step(stages: Sequence[Sequence[Replica]], workload: Workload, host: SharedHost) -> float:
    """The CPU seconds one step costs on `host` (a mean step, with the exchange every `sync_every`): each replica's
    compute for its micro-batches (of the mean size), every replica's overhead and its exchange's bytes (sent and
    received), and the rest."""
    taken = step_time(stages, workload).micro_batches
    size = workload.batch_size / workload.micro_batches
    compute = sum(
        r.seconds_per_sample * size * n for stage, counts in zip(stages, taken, strict=True)
        for r, n in zip(stage, counts, strict=True)
    )
    exchange = sum(2 * b * len(s) for s, b in zip(stages, exchange_bytes_per_replica(stages, workload), strict=True))
    return (compute + host.replica_overhead_s * sum(len(s) for s in stages)
            + host.exchange_cpu_per_byte * exchange / workload.sync_every + host.other_cpu_s)


def shared_host_samples_per_second(
    stages: Sequence[Sequence[Replica]], workload: Workload, host: SharedHost
) -> float:
    """Training throughput with every replica on `host`: the mean of `shared_host_step_seconds` over a sync
    period (the exchange every `sync_every` steps)."""
    exchanging = shared_host_step_seconds(stages, workload, host)
    if workload.sync_every == 1:
        return workload.batch_size / exchanging
    local = shared_host_step_seconds(stages, replace(workload, gradient_bytes=(0.0,) * len(stages)), host)
    return workload.batch_size / ((exchanging + (workload.sync_every - 1) * local) / workload.sync_every)


def shared_host_step_seconds(stages: Sequence[Sequence[Replica]], workload: Workload, host: SharedHost) -> float:
    """One step with every replica a process on `host`: the replay of `step_time` (the same routes, lists and
    links), but the replicas computing at one moment share the host's cores (processor sharing: n of them on
    c cores each run at min(1, c / n) of a core), the exchange's CPU (`exchange_cpu_per_byte` of each phase's
    bytes sent and received, before its bytes leave) and each replica's overhead (after its stage's exchange)
    computed likewise, and what else runs there (`other_cpu_s` per step) taking its share of the cores
    throughout. Until the last replica's overhead is done."""
    return _shared_step(tuple(tuple(s) for s in stages), workload, host)


@lru_cache(maxsize=1024)
def _shared_step(stages: tuple[tuple[Replica, ...], ...], w: Workload, host: SharedHost) -> float:
    if host.other_cpu_s == 0:
        return _shared_replay(stages, w, host, host.cores)
    # The others take other_cpu_s / T of the cores over a step of T seconds, which depends on the cores left: T is
    # the fixed point, found by bisection (the replay's time only grows as the cores it gets shrink).
    low = _shared_replay(stages, w, host, host.cores)
    high = low + host.other_cpu_s / host.cores
    while _shared_replay(stages, w, host, _left(host, high)) > high:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        if _shared_replay(stages, w, host, _left(host, mid)) > mid:
            low = mid
        else:
            high = mid
        if high - low <= 1e-9 * high:
            break
    return high


def _left(host: SharedHost, seconds: float) -> float:
    """The cores the replicas get in a step of `seconds` while the others take other_cpu_s of it."""
    return max(1e-3 * host.cores, host.cores - host.other_cpu_s / seconds)


def _shared_replay(stages: tuple[tuple[Replica, ...], ...], w: Workload, host: SharedHost, cores: float) -> float:
    n = len(stages)
    if n != len(w.gradient_bytes) or any(not s for s in stages):
        raise ValueError(f"{n} stages, each with replicas, for a workload of {len(w.gradient_bytes)} stages")
    replicas = {(i, k): r for i, s in enumerate(stages) for k, r in enumerate(s)}
    routes = route_step(w.micro_batches, [list(range(len(s))) for s in stages],
                        {key: 1 / r.seconds_per_sample for key, r in replicas.items()})
    size, extra = divmod(w.batch_size, w.micro_batches)
    samples = [size + (1 if m < extra else 0) for m in range(w.micro_batches)]
    uplink = _Uplinks(replicas)
    deepest = max(len(s) for s in stages)
    todo = {(i, k): list(replica_schedule(w.schedule, n, i, routes.micro_batches_of(i, k), replicas=deepest))
            for i, k in replicas}
    shard = exchange_bytes_per_replica(stages, w)  # sent (and received) over both phases
    ready: dict[tuple[str, int, int], float] = {("F", 0, m): 0.0 for m in range(w.micro_batches)}
    ready.update({("B", n - 1, m): 0.0 for m in range(w.micro_batches)})  # the last stage's follows its forward
    # Each replica: what it computes now (remaining CPU seconds, and what to do when done), or None.
    running: dict[tuple[int, int], list] = {}
    waiting: dict[tuple[int, int], float] = {}  # replica -> when its next CPU task may start (exchange phases)
    phase = dict.fromkeys(replicas, "actions")
    arrived: dict[tuple[int, str], dict[int, float]] = {}  # (stage, phase) -> replica -> its bytes' arrival
    now, end = 0.0, 0.0

    def start(key: tuple[int, int]) -> None:
        """Give `key` its next CPU task, if it can start now."""
        i, k = key
        if key in running or waiting.get(key, 0.0) > now:
            return
        if phase[key] == "actions":
            actions = todo[key]
            if actions:
                a = actions[0]
                at = ready.get((a.kind, i, a.micro_batch))
                if at is not None and at <= now:
                    share = w.forward_share if a.kind == "F" else 1 - w.forward_share
                    running[key] = [replicas[key].seconds_per_sample * samples[a.micro_batch] * share, "action"]
                return
            phase[key] = "computed"
        if phase[key] == "computed":
            # The exchange starts once every replica of the stage took its last backward: asked of their lists, not
            # of their phases, which a replica visited before this one in this pass has not yet updated.
            if any(todo[(i, j)] for j in range(len(stages[i]))):
                return
            phase[key] = "reduce" if shard[i] > 0 else "overhead"
        if phase[key] in ("reduce", "gather"):
            running[key] = [host.exchange_cpu_per_byte * shard[i], phase[key]]  # half sent, half received per phase
        elif phase[key] == "overhead":
            running[key] = [host.replica_overhead_s, "overhead"]

    def finish(key: tuple[int, int], what: str) -> None:
        nonlocal end
        i, k = key
        if what == "action":
            a = todo[key].pop(0)
            m = a.micro_batch
            if a.kind == "F" and i < n - 1:  # (the last stage's backward follows its forward: its list's order)
                ready[("F", i + 1, m)] = uplink.arrival(
                    key, (i + 1, routes.of[m][i + 1]), now, w.boundary_bytes_per_sample[i] * samples[m])
            elif a.kind == "B" and i > 0:
                ready[("B", i - 1, m)] = uplink.arrival(
                    key, (i - 1, routes.of[m][i - 1]), now, w.boundary_bytes_per_sample[i - 1] * samples[m])
        elif what in ("reduce", "gather"):
            sent = arrived.setdefault((i, what), {})
            sent[k] = uplink.spread(key, [(i, j) for j in range(len(stages[i])) if j != k], now, shard[i] / 2)
            phase[key] = f"{what} sent"
            members = range(len(stages[i]))
            if len(sent) == len(stages[i]):  # every member's bytes are on their way: the phase ends when all arrived
                done = max(sent.values())
                for j in members:
                    phase[(i, j)] = "gather" if what == "reduce" else "overhead"
                    waiting[(i, j)] = done
        else:
            phase[key] = "done"
            end = max(end, now)

    while True:
        for key in replicas:
            start(key)
        if not running:
            later = [t for t in (*ready.values(), *waiting.values()) if t > now]
            if all(p == "done" for p in phase.values()):
                return max(end, now)
            if not later:
                raise RuntimeError("the replicas' schedules deadlocked")  # replica_schedule proves they cannot
            now = min(later)
            continue
        rate = min(1.0, cores / len(running))
        step = min(rem / rate for rem, _ in running.values())
        later = [t for t in (*ready.values(), *waiting.values()) if t > now]
        step = min([step, *(t - now for t in later)])
        now += step
        for key in list(running):
            running[key][0] -= step * rate
            if running[key][0] <= 1e-12:
                _, what = running.pop(key)
                finish(key, what)
