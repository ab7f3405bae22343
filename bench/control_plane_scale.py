"""How many agents one control plane holds: N simulated agents register and heartbeat at the real protocol while
jobs are submitted, placed, and moved off nodes that go silent.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/control_plane_scale.py \
        [--agents 10000] [--interval 10] [--jobs 1000] [--duration 90] [--grace 30] [--silent 5] [--workdir DIR]

The control plane is a whole deployment on this machine (devtools.cluster.LocalCluster: gunicorn, the Celery
control and reachability workers and beat, against the PostgreSQL and Redis the URLs name; never SQLite at this
size; `--workdir` keeps its logs). Each simulated agent registers at a loopback address of its own where
nothing listens, so the dial-backs (controlplane/nodes/reachability.py) are refused here and mark it relayed. The agents
are coroutines of this process (aiohttp, no torch): each registers (`POST /api/agent/register`), then heartbeats
every `--interval` seconds (`POST /api/agent/heartbeat`, starting at a random offset), its body a real agent's
(nodeagent/control_plane.py: the observed stages, the host's load, the relay report, the assignments version it
holds; not the link it measures every 5 minutes): an agent given assignments reports every stage ready at its
generation at once, in one more heartbeat (as a real agent reports a change it applied), then in every heartbeat,
so the hosting agents' unchanged reports take the quiet path (controlplane/agents/heartbeat.py) and the jobs start.
No training driver runs (the training worker is stopped once it is measured idle): the bench stands
in for each running job's driver (`drive_jobs`, in a process of its own), claiming its lease and writing one step
of progress per job every interval, the reports that fall due together recorded in one transaction
(`jobs_record_progress`, the batched form of the driver's own `job_record_steps`: the step and its loss, the stages'
counters billed to the ledger, their time per step, the node speeds they give), with a driver lease
(`--driver-lease`) outlasting the writers' slowest round. The heartbeats travel over a light client of this
bench (`Connection`: uvloop, each agent's own keep-alive connection as a real agent holds one, its request bytes
built once per assignments version) so that
the load generator, which shares the machine's cores, is not what limits the run; a heartbeat's latency runs
from its send (connecting, when the server had closed the connection, included) to its whole answer, and every
answer that is not 200, every timeout (a real agent's 10 s) and every broken connection counts as an error (and
is retried after a real agent's backoff: 1 s, doubling up to 30 s).
Nodes and jobs are made through the services (`node_create`'s token and row, `job_submit`, `job_start`): minting
10,000 tokens through the throttled API is not what is measured.

Measured: heartbeats per second, their latency (p50, p99, max) and errors; how many the control plane's quiet path
handed to Django, and why (its /metrics: arceus_heartbeats_to_django_total); the bench process's CPU per
heartbeat (the load generator's cost, with its once-a-second placement polls) and how late its event loop ran
(every heartbeat in flight meanwhile is timed that much slower); the reconcile pass time (the control
worker's own log of each `arceus.reconcile` task: under the same load); and, for `--silent` nodes hosting a
stage whose heartbeats stop, the time from their last heartbeat to their stage's move, against the grace; the
nodes hosting stages and the jobs running; the progress writes (per second, their latency); and the control
plane's resident memory once the jobs run (every process but the training worker's: RSS and PSS summed, per
running job), beside what it is with the training worker (measured idle at start-up: one process whose threads are
the drivers, controlplane/common/worker_pool.py; what each running driver adds to it: bench/driver_memory.py).
A run that places nothing, or whose agents time out, still reports (nothing is measured that was not seen).
Prints a table, writes docs/BENCHMARKS.md, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import uvloop
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import report  # noqa: E402
from controlplane.common.garbage_collector import garbage_collector_tuned  # noqa: E402
from devtools.cluster import LocalCluster  # noqa: E402

BENCH_USER = "scale-bench"
DRIVER = "scale-bench-driver"  # the driver lease's owner the bench's stand-in drivers write progress as
CAPABILITIES = {"device_type": "cpu", "device_name": "simulated", "memory_bytes": 8 << 30, "flops_fp32": 1e11,
                "runtime_bytes": 0}
JOB: dict[str, Any] = {
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32},
    "stages": 3,
    "requirements": {"owner_diversity": False},  # every node here is the bench user's
}
REGISTERING_AT_ONCE = 512
REGISTER_TRIES = 3  # an agent whose registration fails this often is left out of the fleet (and reported)
# A real agent's (nodeagent/control_plane.py: ControlPlaneClient's timeout, HeartbeatLoop's backoff after a failure).
TIMEOUT_S = 10.0
MIN_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
LAG_SAMPLE_S = 0.01
MIB = 1 << 20
RECONCILE_LINE = re.compile(r"Task arceus\.reconcile\[[^\]]+\] succeeded in ([0-9.e-]+)s")


@dataclass
class SimAgent:
    node_id: str
    token: str
    version: str = ""  # the assignments version it holds (empty: none yet)
    silenced: bool = False
    connection: Connection | None = None  # its one keep-alive connection, as a real agent's requests.Session
    last_beat: float = 0.0  # wall-clock time of its last answered heartbeat
    # What it reports of its assigned stages, as a real agent's registry does once it built them (every one
    # ready at its assignment's generation): arceus.contracts.observed.
    observed: list[dict[str, Any]] = field(default_factory=list)
    busy: float = 0.0  # the host's load beside the agent it reports (`host_busy_fraction`)


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)  # those of answers with new assignments
    reports: list[float] = field(default_factory=list)  # those of heartbeats reporting a change the agent applied
    placing: int = 0  # how many of `latencies`, and of `reports`, were taken while the jobs were being placed
    reports_placing: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # in the measured window
    startup_errors: dict[str, int] = field(default_factory=dict)  # before it: registration's burst of first beats
    lags: list[float] = field(default_factory=list)  # the bench's own event loop's lateness, sampled (`loop_lag`)
    counting: bool = False

    def error(self, kind: str) -> None:
        errors = self.errors if self.counting else self.startup_errors
        errors[kind] = errors.get(kind, 0) + 1


@dataclass
class Progress:
    """The stand-in drivers' writes (`drive_jobs`)."""

    claimed: set[str] = field(default_factory=set)  # jobs whose driver lease they hold
    steps: dict[str, int] = field(default_factory=dict)  # job → the last step recorded
    lost: set[str] = field(default_factory=set)  # jobs whose lease was gone at a write
    written: int = 0  # in the measured window
    seconds: list[float] = field(default_factory=list)  # each write's, in the window
    counting: bool = False


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _setup_django(env: dict[str, str]) -> None:
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "REDIS_URL", "ARCEUS_SECRET_KEY", "DJANGO_SETTINGS_MODULE",
                                           "ARCEUS_NODE_GRACE_SECONDS", "ARCEUS_DRIVER_LEASE_SECONDS",
                                           "ARCEUS_MAX_PLACEMENTS_PER_PASS") if k in env})
    import django

    django.setup()


def make_nodes(count: int) -> list[SimAgent]:
    """`count` nodes of the bench's own user, their tokens minted as `node_create` mints them (in bulk)."""
    from django.contrib.auth import get_user_model
    from django.db import OperationalError, connection, transaction

    from controlplane.jobs.models import Job, StageContribution
    from controlplane.market.models import LedgerEntry
    from controlplane.nodes.models import Node
    from controlplane.nodes.services import _node_token_new, node_token_hash

    user_model = get_user_model()
    # A previous run's nodes and jobs; first what their progress billed (its rows PROTECT nodes, jobs and each
    # other: one DELETE each, in SQL, as the collector refuses them). The control plane already runs, and its
    # passes may write those jobs meanwhile: a deadlock with one is tried again.
    for attempt in range(5):
        try:
            with transaction.atomic():
                jobs = Job.objects.filter(owner__username=BENCH_USER).values("pk")
                for model in (LedgerEntry, StageContribution):
                    sql, params = jobs.query.sql_with_params()
                    with connection.cursor() as cursor:
                        cursor.execute(f"DELETE FROM {model._meta.db_table} WHERE job_id IN ({sql})",  # noqa: S608
                                       params)
                user_model.objects.filter(username=BENCH_USER).delete()
            break
        except OperationalError:
            if attempt == 4:
                raise
            time.sleep(1.0)
    user = user_model.objects.create_user(username=BENCH_USER, password=None)
    tokens = [_node_token_new() for _ in range(count)]
    nodes = Node.objects.bulk_create(
        [Node(owner=user, name=f"sim-{i}", token_hash=node_token_hash(t)) for i, t in enumerate(tokens)],
        batch_size=2000,
    )
    return [SimAgent(str(n.id), t, busy=round(random.uniform(0.0, 0.3), 3)) for n, t in zip(nodes, tokens, strict=True)]


def submit_jobs(count: int) -> list[str]:
    from django.contrib.auth import get_user_model

    from controlplane.jobs.services import job_start, job_submit

    user = get_user_model().objects.get(username=BENCH_USER)
    ids = []
    for _ in range(count):
        job = job_submit(owner=user, **JOB)
        job_start(job=job)
        ids.append(str(job.id))
    return ids


def drivers_claim() -> list[str]:
    """Claim the driver lease of each running job of the bench's that nobody holds, as its training driver task
    would (`job_driver_claim`); the ids claimed."""
    from django.utils import timezone

    from arceus.contracts.status import JobStatus
    from controlplane.jobs.leases import job_driver_claim
    from controlplane.jobs.models import Job

    now = timezone.now()
    pending = Job.objects.filter(owner__username=BENCH_USER, status=JobStatus.RUNNING,
                                 driver_lease_owner="").values_list("pk", flat=True)
    return [str(pk) for pk in pending if job_driver_claim(job_id=pk, owner=DRIVER, now=now)]


def progress_record(due: list[tuple[str, int]]) -> tuple[list[str], list[float]]:
    """One training step's progress for each (job, step), as a driver reports it (the step and its loss, the stages'
    cumulative counters and time per step, the node speeds they measure, the lease renewed), all in one
    `jobs_record_progress`; the jobs whose lease was gone, and the latency each report saw (its batch's seconds)."""
    from django.db import OperationalError
    from django.utils import timezone

    from arceus.contracts.counters import StageCounters
    from arceus.training.plan import StageTiming
    from controlplane.driver.recording import ProgressReport, StepPoint, jobs_record_progress

    batch = JOB["dataset_config"]["batch_size"]
    reports = []
    for job_id, step in due:
        point = StepPoint(epoch=step // 50, step=step, total_steps=10_000, loss=2.3 / (1 + step / 100),
                          samples_per_second=320.0)
        counters = [StageCounters(index=i, samples=batch * step, micro_batches=4 * step, compute_seconds=0.02 * step,
                                  bytes_sent=40_000 * step, bytes_received=40_000 * step)
                    for i in range(JOB["stages"])]
        timings = [StageTiming(i, 0.02, 0.01, 0.1, samples=batch, micro_batches=4) for i in range(JOB["stages"])]
        reports.append(ProgressReport(job_id=job_id, lease_owner=DRIVER, points=[point], stages=counters,
                                      timings=timings))
    started = time.perf_counter()
    for attempt in range(3):  # a deadlock with a reconcile pass's transaction is tried again
        try:
            held = jobs_record_progress(reports=reports, now=timezone.now())
            break
        except OperationalError:
            if attempt == 2:
                raise
    seconds = time.perf_counter() - started
    return [job_id for (job_id, _), ok in zip(due, held, strict=True) if not ok], [seconds] * len(due)


async def drive_jobs(drivers: Executor, interval: float, progress: Progress, stop: asyncio.Event) -> None:
    """Stand in for the running jobs' drivers (none runs here: the training worker is stopped): claim each
    running job's lease, then record one step of progress per job every `interval` s (the agents' heartbeat
    interval), each job at an offset of its own. In `drivers`, another process: their Python work must not
    hold this one's GIL."""
    loop = asyncio.get_running_loop()
    due: dict[str, float] = {}  # job → when its next progress is due
    while not stop.is_set():
        now = time.monotonic()
        for job_id in await loop.run_in_executor(drivers, drivers_claim):
            due[job_id] = now + random.uniform(0, interval)
            progress.claimed.add(job_id)
        ready = [job_id for job_id, at in due.items() if at <= now]
        if ready:
            steps = [(job_id, progress.steps.get(job_id, 0) + 1) for job_id in ready]
            lost, seconds = await loop.run_in_executor(drivers, progress_record, steps)
            for job_id, step in steps:
                progress.steps[job_id] = step
                due[job_id] += interval
            for job_id in lost:
                due.pop(job_id, None)
            progress.lost.update(lost)
            if progress.counting:
                progress.written += len(steps) - len(lost)
                progress.seconds += seconds
        await asyncio.sleep(max(0.0, 0.2 - (time.monotonic() - now)))


async def heartbeats_to_django(session: aiohttp.ClientSession, cluster: LocalCluster) -> dict[str, float] | str:
    """The control plane's count of heartbeats its quiet path handed to Django, by reason (its /metrics); or why it
    was not read (the web process did not answer in time: an overloaded control plane is reported, not a crash)."""
    try:
        async with session.get(f"{cluster.api_url}/metrics",
                               headers={"Authorization": f"Bearer {cluster.metrics_token}"}) as response:
            if response.status != 200:
                return f"GET /metrics: HTTP {response.status}"
            text = await response.text()
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"GET /metrics: {type(exc).__name__}"
    return {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "arceus_heartbeats_to_django" for sample in family.samples
            if sample.name.endswith("_total")}


def to_django_since(before: dict[str, float] | str, after: dict[str, float] | str) -> dict[str, int] | str:
    """The heartbeats handed to Django between two reads, by reason; or why one read failed."""
    if isinstance(before, str) or isinstance(after, str):
        return before if isinstance(before, str) else after  # type: ignore[return-value]
    return {reason: int(n - before.get(reason, 0)) for reason, n in after.items()}


def placed_nodes() -> dict[str, str]:
    """node id → job id of every active stage row of the bench's jobs."""
    from controlplane.jobs.models import Stage

    rows = Stage.objects.filter(active=True, node__isnull=False, job__owner__username=BENCH_USER)
    return {str(n): str(j) for n, j in rows.values_list("node_id", "job_id")}


async def register(session: aiohttp.ClientSession, url: str, agent: SimAgent, i: int) -> None:
    """As an agent registers: its own TLS key (one node each), proved by signing the control plane's challenge."""
    from arceus.contracts.possession import possession_sign
    from arceus.wire.tls import new_identity

    identity = new_identity()
    headers = {"Authorization": f"Node {agent.token}"}
    async with session.post(f"{url}/api/agent/challenge", json={}, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"challenge failed: HTTP {response.status} {await response.text()}")
        challenge = (await response.json())["challenge"]
    # A loopback address of its own where nothing listens: the control plane's dial-back after registration
    # (controlplane/nodes/reachability.py) is refused at once and stays on this machine.
    body = {"grpc_address": f"127.{1 + (i >> 16 & 254)}.{i >> 8 & 255}.{i & 255}:9", "capabilities": CAPABILITIES,
            "tls_certificate": identity.certificate, "challenge": challenge,
            "tls_proof": possession_sign(identity.key_pem, challenge, identity.certificate)}
    async with session.post(f"{url}/api/agent/register", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"registration failed: HTTP {response.status} {await response.text()}")


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: a request's bytes out, (status, body) back; nothing else of HTTP."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionResetError("the server closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.answer is None or self.answer.done():  # done: its waiter timed out (then closed)
            return
        head = bytes(self.buffer[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        length = int(head[at + 17:].split(b"\r\n", 1)[0]) if at > 0 else 0
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4:end + 4 + length])
        del self.buffer[:end + 4 + length]
        if b"\r\nconnection: close" in head:
            self.closed = True
        self.answer.set_result((int(head[9:12]), body))

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(raw)  # type: ignore[union-attr]
        return await self.answer


async def post(agent: SimAgent, host: str, port: int, raw: bytes) -> tuple[int, bytes]:
    """One request on the agent's own keep-alive connection (opened again when the server closed it), answered
    within the agents' own timeout, connecting included."""
    async with asyncio.timeout(TIMEOUT_S):
        if agent.connection is None or agent.connection.closed:
            _, agent.connection = await asyncio.get_running_loop().create_connection(Connection, host, port)
        try:
            return await agent.connection.request(raw)
        except BaseException:
            agent.connection.transport.close()  # type: ignore[union-attr] (its state is unknown)
            raise


def heartbeat_request(host: str, agent: SimAgent) -> bytes:
    """The body a real agent sends (nodeagent/control_plane.py: ControlPlaneClient.heartbeat): its stages'
    observed states, the host's load, its relay report (none: no relays here) and the version it holds (once it
    holds one). Not sent: the link it measures every 5 minutes (REMEASURE_SECONDS) and neighbour links."""
    payload: dict[str, Any] = {"observed": agent.observed, "host_busy_fraction": agent.busy, "relay": None}
    if agent.version:
        payload["assignments_version"] = agent.version
    body = json.dumps(payload).encode()
    return (f"POST /api/agent/heartbeat HTTP/1.1\r\nHost: {host}\r\nAuthorization: Node {agent.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def heartbeat_forever(host: str, port: int, agent: SimAgent, interval: float, tally: Tally,
                            stop: asyncio.Event) -> None:
    await asyncio.sleep(random.uniform(0, interval))
    raw, held = heartbeat_request(f"{host}:{port}", agent), agent.version
    backoff, resend = MIN_BACKOFF_S, False
    while not stop.is_set() and not agent.silenced:
        started, failure, applied = time.perf_counter(), None, False
        try:
            status, body = await post(agent, host, port, raw)
            if status != 200:
                failure = f"HTTP {status}"
            else:
                answer = json.loads(body)
                agent.version, agent.last_beat = answer.get("assignments_version", ""), time.time()
                if tally.counting:
                    tally.latencies.append(time.perf_counter() - started)
                    if answer.get("assignments"):
                        tally.changed.append(tally.latencies[-1])
                    if resend:
                        tally.reports.append(tally.latencies[-1])
                if "assignments" in answer:  # a new desired state: its stages built at once, all ready
                    observed = [{"stage_id": a["stage_id"], "generation": a["generation"], "state": "ready",
                                 "message": ""} for a in answer["assignments"]]
                    applied, agent.observed = observed != agent.observed, observed
                if agent.version != held or applied:
                    raw, held = heartbeat_request(f"{host}:{port}", agent), agent.version
        except (OSError, TimeoutError, ValueError) as exc:
            failure = type(exc).__name__
        if failure is None:
            backoff = MIN_BACKOFF_S
            # As a real agent (HeartbeatLoop._run): a change applied is reported at once, but not twice in a row.
            resend = applied and not resend
            if not resend:
                await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))
        else:  # as a real agent backs off (nodeagent/control_plane.py: HeartbeatLoop)
            tally.error(failure)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_S)


async def loop_lag(tally: Tally, stop: asyncio.Event) -> None:
    """How late this process's event loop wakes a 10 ms sleep, sampled through the window: every heartbeat in
    flight while the loop is late is timed that much slower, though the server answered in time."""
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(LAG_SAMPLE_S)
        if tally.counting:
            tally.lags.append(time.perf_counter() - started - LAG_SAMPLE_S)


async def run_fleet(
    cluster: LocalCluster, agents: list[SimAgent], args: argparse.Namespace, database: Executor, drivers: Executor
) -> dict[str, Any]:
    """`database` runs the bench's own queries and submissions, `drivers` the stand-in drivers' writes
    (`drive_jobs`): each in another process, so that their Python work never holds this one's GIL while heartbeats
    wait to be timed (a thread's 1,000 job submissions delayed every heartbeat of the fleet by up to a minute)."""
    loop = asyncio.get_running_loop()
    # Registrations go through Django, each a few ms: 512 at a time, or 10,000 at once would wait past the timeout.
    connector = aiohttp.TCPConnector(limit=REGISTERING_AT_ONCE)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        gate = asyncio.Semaphore(REGISTERING_AT_ONCE)

        registration_errors: dict[str, int] = {}

        async def gated(i: int, agent: SimAgent) -> bool:
            """Registered, tried again after a real agent's backoff while it fails (at most REGISTER_TRIES times)."""
            backoff = MIN_BACKOFF_S
            for _ in range(REGISTER_TRIES):
                async with gate:
                    try:
                        await register(session, cluster.api_url, agent, i)
                        return True
                    except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
                        kind = type(exc).__name__
                registration_errors[kind] = registration_errors.get(kind, 0) + 1
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
            return False

        fleet = len(agents)
        registered = await asyncio.gather(*(gated(i, a) for i, a in enumerate(agents)))
        agents = [a for a, ok in zip(agents, registered, strict=True) if ok]  # the others never heartbeat
        registered_s = time.perf_counter() - started
        print(f"registered {len(agents)} of {fleet} agents in {registered_s:.1f} s"
              + (f" (errors {registration_errors})" if registration_errors else ""), flush=True)

        tally, progress, stop = Tally(), Progress(), asyncio.Event()
        # This one process stands for 10,000 agents' machines: its collector tuned as the control plane's.
        garbage_collector_tuned()
        lag_probe = asyncio.create_task(loop_lag(tally, stop))
        host, port = cluster.api_url.removeprefix("http://").rsplit(":", 1)
        beats = [asyncio.create_task(heartbeat_forever(host, int(port), a, args.interval, tally, stop))
                 for a in agents]
        driving = asyncio.create_task(drive_jobs(drivers, args.interval, progress, stop))
        try:
            # Every agent's first heartbeat (through the API: it makes the node Ready) answered before the window
            # opens: 10,000 agents starting within one interval are a start-up burst, not the steady state.
            first_started = time.perf_counter()
            while not all(a.last_beat for a in agents) and time.perf_counter() - first_started < 10 * args.interval:
                await asyncio.sleep(0.5)
            answered, first_s = sum(1 for a in agents if a.last_beat), time.perf_counter() - first_started
            print(f"{answered:,} agents' first heartbeats answered in {first_s:.1f} s", flush=True)
            log = cluster.supervisor.log_dir / "worker-control.log"
            log_offset = log.stat().st_size
            to_django_before = await heartbeats_to_django(session, cluster)
            memory_before = control_plane_memory(cluster)  # the fleet heartbeating, no job yet
            tally.counting, window_start = True, time.perf_counter()  # the placement burst is measured too
            progress.counting = True
            cpu_start = time.process_time()
            jobs = await loop.run_in_executor(database, submit_jobs, args.jobs)
            print(f"submitted {len(jobs)} jobs", flush=True)
            placed = await _until_placed(database, args.jobs * JOB["stages"], args.place_timeout)
            placement_s, tally.placing, tally.reports_placing = (time.perf_counter() - window_start,
                                                                  len(tally.latencies), len(tally.reports))
            while_placing = tally.placing
            print(f"placed {len(placed)} stages in {placement_s:.0f} s", flush=True)
            while len(progress.claimed) < len(jobs) and time.perf_counter() - window_start < args.place_timeout:
                await asyncio.sleep(0.5)  # every job running: its stages reported ready, its lease claimed
            running_s = time.perf_counter() - window_start
            print(f"{len(progress.claimed)} jobs running after {running_s:.0f} s", flush=True)
            by_id = {a.node_id: a for a in agents}
            # Hosts whose heartbeats were answered: the silence is timed from the last answered one.
            hosts = sorted(n for n in placed if by_id[n].last_beat)
            victims = [by_id[n] for n in random.sample(hosts, min(args.silent, len(hosts)))]
            if not victims:
                print("no placed node had an answered heartbeat: none goes silent, the reassignment is not measured",
                      flush=True)
            await asyncio.sleep(args.duration / 3)
            for victim in victims:
                victim.silenced = True
            reassigned = await _until_moved(database, victims, args.grace + 30)
            await asyncio.sleep(max(0.0, args.duration - (time.perf_counter() - window_start)))
            tally.counting, progress.counting, window = False, False, time.perf_counter() - window_start
            bench_cpu = time.process_time() - cpu_start
            memory = control_plane_memory(cluster)
            running = await loop.run_in_executor(database, jobs_running)
            to_django = to_django_since(to_django_before, await heartbeats_to_django(session, cluster))
        finally:  # the agents stop before the session closes, also when the run failed
            stop.set()
            for task in beats:
                task.cancel()
            await asyncio.gather(*beats, lag_probe, driving, return_exceptions=True)
    unknown = await loop.run_in_executor(database, nodes_unknown)
    passes = [float(m) for m in RECONCILE_LINE.findall(log.read_bytes()[log_offset:].decode(errors="replace"))]
    delays = [reassigned[v.node_id] - v.last_beat for v in victims if v.node_id in reassigned]
    return {
        "agents": fleet, "registered": len(agents), "registration_errors": registration_errors,
        "interval_s": args.interval, "jobs": len(jobs), "window_s": round(window, 1),
        "placements_per_pass": args.placements_per_pass,
        "registration_s": round(registered_s, 1),
        "first_answered": answered, "first_heartbeats_s": round(first_s, 1),
        "placed_stages": len(placed), "placement_s": round(placement_s),
        "heartbeats": len(tally.latencies), "heartbeats_per_s": round(len(tally.latencies) / window, 1),
        "p50_ms": round(quantile(tally.latencies, 0.5) * 1e3, 1),
        "p99_ms": round(quantile(tally.latencies, 0.99) * 1e3, 1),
        "max_ms": round(max(tally.latencies, default=float("nan")) * 1e3, 1),
        "p99_placing_ms": round(quantile(tally.latencies[:while_placing], 0.99) * 1e3, 1),
        "p99_placed_ms": round(quantile(tally.latencies[while_placing:], 0.99) * 1e3, 1),
        "changed": len(tally.changed), "changed_p50_ms": round(quantile(tally.changed, 0.5) * 1e3, 1),
        "changed_p99_ms": round(quantile(tally.changed, 0.99) * 1e3, 1),
        "reports": len(tally.reports), "reports_p50_ms": round(quantile(tally.reports, 0.5) * 1e3, 1),
        "reports_p99_ms": round(quantile(tally.reports, 0.99) * 1e3, 1),
        "reports_placing": tally.reports_placing,
        "reports_p99_placing_ms": round(quantile(tally.reports[:tally.reports_placing], 0.99) * 1e3, 1),
        "errors": sum(tally.errors.values()), "error_kinds": tally.errors,
        "startup_errors": sum(tally.startup_errors.values()), "startup_error_kinds": tally.startup_errors,
        "to_django": None if isinstance(to_django, str) else sum(to_django.values()), "to_django_reasons": to_django,
        "bench_cpu_ms_per_heartbeat": round(bench_cpu / max(1, len(tally.latencies)) * 1e3, 3),
        "bench_lag_p99_ms": round(quantile(tally.lags, 0.99) * 1e3, 1),
        "bench_lag_max_ms": round(max(tally.lags, default=float("nan")) * 1e3, 1),
        "reconcile_passes": len(passes),
        "reconcile_p50_s": round(quantile(passes, 0.5), 3), "reconcile_max_s": round(max(passes, default=0.0), 3),
        "grace_s": args.grace, "silent": len(victims), "reassigned": len(delays),
        "reassign_max_s": round(max(delays, default=float("nan")), 1),
        "reassign_median_s": round(statistics.median(delays), 1) if delays else None,
        "reachability_unknown": unknown,
        "hosts": len(set(placed)), "running_jobs": running, "claimed": len(progress.claimed),
        "running_s": round(running_s),
        "progress_writes": progress.written, "progress_per_s": round(progress.written / window, 1),
        "progress_p50_ms": round(quantile(progress.seconds, 0.5) * 1e3, 1),
        "progress_p99_ms": round(quantile(progress.seconds, 0.99) * 1e3, 1),
        "progress_lost_leases": len(progress.lost),
        **memory, **per_job_memory(memory, memory_before, running, args.training_worker_mib),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def jobs_running() -> int:
    from arceus.contracts.status import JobStatus
    from controlplane.jobs.models import Job

    return Job.objects.filter(owner__username=BENCH_USER, status=JobStatus.RUNNING).count()


CONTROL_PLANE = ("web", "worker-control", "worker-reachability", "beat")  # every part but the training worker


def control_plane_memory(cluster: LocalCluster) -> dict[str, Any]:
    """The resident memory of the control plane's processes (gunicorn's and the Celery workers' children
    included) in MiB: RSS summed, and PSS summed (pages shared after a fork counted once); and the RSS of each
    part."""
    parts = {name: [psutil.Process(pid).memory_full_info() for pid in cluster.process_ids(name)]
             for name in CONTROL_PLANE}
    infos = [info for part in parts.values() for info in part]
    return {"control_plane_processes": len(infos),
            "control_plane_rss_mib": round(sum(i.rss for i in infos) / MIB, 1),
            "control_plane_pss_mib": round(sum(i.pss for i in infos) / MIB, 1),
            "rss_by_part_mib": {name: round(sum(i.rss for i in part) / MIB, 1) for name, part in parts.items()}}


def training_worker_mib(cluster: LocalCluster) -> float:
    """The RSS of the training worker, idle once it takes tasks, in MiB: its processes summed (one, whose threads are
    the drivers: controlplane/common/worker_pool.py)."""
    cluster.wait_for_worker("worker-training")
    return round(sum(psutil.Process(pid).memory_info().rss for pid in cluster.process_ids("worker-training")) / MIB, 1)


def per_job_memory(memory: dict[str, Any], before: dict[str, Any], running: int,
                   worker_mib: float) -> dict[str, Any]:
    """The control plane's memory per running job: without the training worker (as measured: all of it, and what it
    grew by since the jobs came), and with the training worker held once for all of them (its idle RSS; what each
    driver adds to it is bench/driver_memory.py's)."""
    jobs = max(1, running)
    return {"training_worker_mib": worker_mib,
            "rss_before_jobs_mib": before["control_plane_rss_mib"],
            "rss_by_part_before_jobs_mib": before["rss_by_part_mib"],
            "rss_growth_per_job_mib": round((memory["control_plane_rss_mib"] - before["control_plane_rss_mib"]) / jobs,
                                            3),
            "rss_per_job_mib": round(memory["control_plane_rss_mib"] / jobs, 3),
            "pss_per_job_mib": round(memory["control_plane_pss_mib"] / jobs, 3),
            "rss_with_training_worker_mib": round(memory["control_plane_rss_mib"] + worker_mib, 1),
            "rss_per_job_with_training_worker_mib": round((memory["control_plane_rss_mib"] + worker_mib) / jobs, 3)}


def nodes_unknown() -> int:
    """The bench's nodes not yet dialled back (controlplane/nodes/reachability.py)."""
    from controlplane.nodes.models import Node, Reachability

    return Node.objects.filter(owner__username=BENCH_USER, reachability=Reachability.UNKNOWN).count()


async def _until_placed(database: Executor, count: int, timeout: float) -> dict[str, str]:
    """The placed stages once there are `count` of them, or those placed after `timeout` s (polled each second)."""
    deadline = time.monotonic() + timeout
    loop = asyncio.get_running_loop()
    while len(placed := await loop.run_in_executor(database, placed_nodes)) < count and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    return placed


async def _until_moved(database: Executor, victims: list[SimAgent], timeout: float) -> dict[str, float]:
    """node id → wall-clock time its stage was seen on another node (polled every 0.2 s)."""
    moved: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    loop = asyncio.get_running_loop()
    while len(moved) < len(victims) and time.monotonic() < deadline:
        hosting = await loop.run_in_executor(database, placed_nodes)
        now = time.time()
        for victim in victims:
            if victim.node_id not in moved and victim.node_id not in hosting:
                moved[victim.node_id] = now
        await asyncio.sleep(0.2)
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--interval", type=float, default=10.0, help="heartbeat interval, seconds")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds measured once jobs are placed")
    parser.add_argument("--grace", type=float, default=30.0, help="node lease (ARCEUS_NODE_GRACE_SECONDS)")
    parser.add_argument("--driver-lease", type=float, default=300.0, help="ARCEUS_DRIVER_LEASE_SECONDS: the "
                        "stand-in drivers renew it only with each job's progress, once an interval (a real driver "
                        "every 0.5 s), so it must outlast their slowest round of writes")
    parser.add_argument("--silent", type=int, default=5, help="nodes hosting a stage that stop heartbeating")
    parser.add_argument("--placements-per-pass", type=int, help="queued jobs one reconcile pass places "
                        "(ARCEUS_MAX_PLACEMENTS_PER_PASS; default: the control plane's)")
    parser.add_argument("--place-timeout", type=float, default=300.0, help="go on after this long placing")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    parser.add_argument("--workdir", type=Path, help="keep the cluster's files and logs here (default: a temporary "
                        "directory, removed after the run)")
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        parser.error("set DATABASE_URL to a PostgreSQL database (and REDIS_URL): SQLite cannot hold this load")
    with tempfile.TemporaryDirectory(prefix="arceus-scale-") as temporary:
        workdir = args.workdir or Path(temporary)
        workdir.mkdir(parents=True, exist_ok=True)
        placements = ({} if args.placements_per_pass is None
                      else {"ARCEUS_MAX_PLACEMENTS_PER_PASS": str(args.placements_per_pass)})
        cluster = LocalCluster(
            workdir, database_url=os.environ["DATABASE_URL"], redis_url=os.environ.get("REDIS_URL"),
            heartbeat_interval_seconds=args.interval, reconcile_interval_seconds=1.0,
            extra_env={**placements, "ARCEUS_NODE_GRACE_SECONDS": str(args.grace), "ARCEUS_LOG_LEVEL": "WARNING",
                       "ARCEUS_DRIVER_LEASE_SECONDS": str(args.driver_lease),
                       # One owner's fleet registering from one address at once: the limits are the bench's size.
                       "ARCEUS_THROTTLE_AGENT_REGISTER_OWNER": f"{args.agents}/min",
                       "ARCEUS_THROTTLE_AGENT_REGISTER_ADDRESS": f"{args.agents}/min"},
        )
        cluster.start()
        try:
            # No driver runs (the bench's stand-ins write their progress: `drive_jobs`); what the drivers' worker holds.
            args.training_worker_mib = training_worker_mib(cluster)
            cluster.crash("worker-training")
            _setup_django(cluster.env)
            from django.conf import settings

            args.placements_per_pass = settings.ARCEUS_MAX_PLACEMENTS_PER_PASS  # the cluster's, from its environment
            agents = make_nodes(args.agents)
            spawn = multiprocessing.get_context("spawn")
            with (ProcessPoolExecutor(1, mp_context=spawn, initializer=_setup_django, initargs=(cluster.env,)) as db,
                  ProcessPoolExecutor(1, mp_context=spawn, initializer=_setup_django,
                                      initargs=(cluster.env,)) as drivers):
                result = uvloop.run(run_fleet(cluster, agents, args, db, drivers))
        finally:
            cluster.stop()
    print_and_write(result, write=not args.no_write)


def print_and_write(r: dict[str, Any], *, write: bool) -> None:
    lines = [
        f"{r['agents']:,} simulated agents heartbeating every {r['interval_s']:g} s, {r['jobs']:,} jobs of 3 stages "
        f"submitted, {r['placements_per_pass']} placed a pass; measured over {r['window_s']:g} s from the submissions "
        f"(load average at the end {r['load_average']}).",
        "",
        "| figure | measured | goal |",
        "| --- | --- | --- |",
        f"| heartbeats/s | {r['heartbeats_per_s']:,} | {r['agents'] / r['interval_s']:,.0f} |",
        f"| heartbeat latency p50 / p99 / max | {r['p50_ms']} / {r['p99_ms']} / {r['max_ms']} ms | p99 < 100 ms |",
        f"| heartbeat latency p99 while placing / once placed | {r['p99_placing_ms']} / {r['p99_placed_ms']} ms | |",
        f"| latency p50 / p99 of the {r['changed']:,} answers with new assignments | "
        f"{r['changed_p50_ms']} / {r['changed_p99_ms']} ms | |",
        f"| latency p50 / p99 of the {r['reports']:,} heartbeats reporting a change the agent applied (p99 of the "
        f"{r['reports_placing']:,} while placing) | {r['reports_p50_ms']} / {r['reports_p99_ms']} "
        f"({r['reports_p99_placing_ms']}) ms | |",
        f"| heartbeat errors | {r['errors']} {r['error_kinds'] or ''} | 0 |",
        f"| heartbeat errors before the window (every agent's first heartbeat) | {r['startup_errors']} "
        f"{r['startup_error_kinds'] or ''} | |",
        f"| heartbeats the quiet path handed to Django, by reason | "
        f"{'not read' if r['to_django'] is None else format(r['to_django'], ',')} {r['to_django_reasons']} | |",
        f"| the bench process's CPU per heartbeat (load generator) | {r['bench_cpu_ms_per_heartbeat']} ms | |",
        f"| the bench process's event loop: lateness p99 / max (in every latency above) | {r['bench_lag_p99_ms']} / "
        f"{r['bench_lag_max_ms']} ms | |",
        f"| reconcile pass p50 / max ({r['reconcile_passes']} passes) | {r['reconcile_p50_s']} / "
        f"{r['reconcile_max_s']} s | < 1 s |",
        f"| silent node → stage moved, max / median ({r['reassigned']}/{r['silent']} moved) | "
        f"{r['reassign_max_s']} / {r['reassign_median_s']} s | < grace {r['grace_s']:g} + 2 s |",
        f"| registration: agents registered, time taken, errors (each retried; an agent failing "
        f"{REGISTER_TRIES} times is left out) | {r['registered']:,} in {r['registration_s']} s, "
        f"{sum(r['registration_errors'].values())} {r['registration_errors'] or ''} | {r['agents']:,}, 0 |",
        f"| every agent's first heartbeat answered (a node becomes Ready) | {r['first_answered']:,} agents in "
        f"{r['first_heartbeats_s']} s | |",
        f"| stages placed (of {r['jobs'] * 3:,}) and time taken | {r['placed_stages']:,} in {r['placement_s']} s | |",
        f"| nodes not yet dialled back at the end | {r['reachability_unknown']:,} | 0 |",
        f"| nodes hosting a stage, reporting it ready in every heartbeat | {r['hosts']:,} | >= 3,000 |",
        f"| jobs running at the end (the stand-in drivers claimed {r['claimed']:,} leases in the {r['running_s']} s "
        f"they waited for all) | {r['running_jobs']:,} | {r['jobs']:,} |",
        f"| progress reports (one per job per {r['interval_s']:g} s, those due together in one `jobs_record_progress`;"
        f" latency: the batch's) | "
        f"{r['progress_per_s']}/s, p50 / p99 {r['progress_p50_ms']} / {r['progress_p99_ms']} ms; "
        f"{r['progress_lost_leases']} leases lost | {r['jobs'] / r['interval_s']:,.0f}/s |",
        f"| control plane's memory, {r['control_plane_processes']} processes (no process per job): RSS / PSS | "
        f"{r['control_plane_rss_mib']:,} / {r['control_plane_pss_mib']:,} MiB | |",
        f"| the same per running job: RSS / PSS | {r['rss_per_job_mib']} / {r['pss_per_job_mib']} MiB | < 1 MiB |",
        f"| RSS growth per running job (from {r['rss_before_jobs_mib']:,} MiB with the fleet and no job) | "
        f"{r['rss_growth_per_job_mib']} MiB | |",
        "| RSS by part, with the fleet and no job → at the end | "
        + ", ".join(f"{name} {r['rss_by_part_before_jobs_mib'][name]:,} → {mib:,} MiB"
                    for name, mib in r["rss_by_part_mib"].items()) + " | |",
        f"| with the training worker ({r['training_worker_mib']} MiB idle, one process for every driver): "
        f"RSS, per job | {r['rss_with_training_worker_mib']:,} MiB, {r['rss_per_job_with_training_worker_mib']} MiB "
        "| < 1 MiB |",
    ]
    body = "\n".join(lines)
    report("control-plane-scale", "Control plane at scale (`bench/control_plane_scale.py`)", body, r, write=write)


if __name__ == "__main__":
    main()
