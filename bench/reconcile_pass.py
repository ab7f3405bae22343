"""What one reconcile pass costs with a large fleet: `--nodes` registered, Ready nodes and `--jobs` placed jobs of 3
stages, timed in-process through the function the `arceus.reconcile` task calls (`reconcile_once`).

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/reconcile_pass.py \
        [--nodes 10000] [--jobs 1000] [--passes 15] [--silent 5] [--new-jobs 100] [--no-write]

The database and Redis the URLs name are filled directly (the bench's own user and everything it owns are dropped
first): nodes made in bulk as bench/control_plane_scale.py makes them, registered with capabilities, Ready, their
leases renewed in Redis before every pass; jobs submitted and started through the services, then placed by
reconcile passes. Half the placed jobs are left placing (waiting for their stages) and half made running with a
live driver lease and ready stages, so a steady pass walks both paths and has nothing to change.

Measured, each the median and max over its passes: wall time and CPU time of this process (CPU beside the
database server's, whose backend this process talks to), split into read (`load_snapshot`), plan (`plan`) and
apply (`execute`) by timing those three calls where `reconcile_once` makes them:
- steady: nothing changed since the previous pass but the leases of the agents whose heartbeat came
  (`--heartbeat-interval`: 10,000 agents every 10 s renew 1,000 a second), and again with every lease renewed;
- silent: `--silent` nodes hosting a stage stopped heartbeating past their lease: they are marked Unknown and
  their stages moved (fresh victims each pass);
- placing: `--new-jobs` jobs submitted at once, placed by as many passes as ARCEUS_MAX_PLACEMENTS_PER_PASS needs.
The pass reads Redis and PostgreSQL on this machine, shared with other work: the figures are medians of passes run
one after another. Prints a table, writes docs/BENCHMARKS.md's reconcile-pass section, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import report  # noqa: E402
from controlplane.common.garbage_collector import garbage_collector_tuned  # noqa: E402

BENCH_USER = "reconcile-bench"
MEMORY, FLOPS = 8 << 30, 1e11
JOB: dict[str, Any] = {
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32},
    "stages": 3,
    "requirements": {"owner_diversity": False},  # every node here is the bench user's
}
PHASES = ("read", "plan", "apply")


def _setup_django(grace: float) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ["ARCEUS_NODE_GRACE_SECONDS"] = str(grace)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def make_fleet(count: int, now: datetime) -> list[str]:
    """`count` registered, Ready nodes of the bench's own user (rows in bulk, as `node_register` leaves them)."""
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from controlplane.nodes.models import Node, NodeLease, Reachability, ReadyStatus
    from controlplane.nodes.services import _node_token_new, node_token_hash

    user_model = get_user_model()
    forget_leases([str(i) for i in Node.objects.filter(owner__username=BENCH_USER).values_list("id", flat=True)])
    user_model.objects.filter(username=BENCH_USER).delete()  # a previous run's nodes and jobs
    user = user_model.objects.create_user(username=BENCH_USER, password=None)
    nodes = Node.objects.bulk_create(
        [
            Node(owner=user, name=f"bench-{i}", token_hash=node_token_hash(_node_token_new()), device_type="cpu",
                 device_name="simulated", memory_bytes=MEMORY, flops_fp32=FLOPS, grpc_address=f"127.0.0.1:{i}",
                 registered_at=now, ready_status=ReadyStatus.TRUE, ready_reason="Heartbeat", ready_transition_at=now,
                 reachability=Reachability.RELAYED)
            for i in range(count)
        ],
        batch_size=2000,
    )
    NodeLease.objects.bulk_create(
        [NodeLease(node=n, renewed_at=now, duration_seconds=settings.ARCEUS_NODE_GRACE_SECONDS) for n in nodes],
        batch_size=2000,
    )
    return [str(n.id) for n in nodes]


def forget_leases(node_ids: list[str]) -> None:
    """Drop nodes' liveness entries (a previous run's, whose rows go: Redis keeps a deleted node's for a week, and
    every pass reads the whole set)."""
    from controlplane.common.redis_client import redis_client
    from controlplane.nodes.liveness import BUSY, LEASES

    for start in range(0, len(node_ids), 5000):
        chunk = node_ids[start:start + 5000]
        redis_client().zrem(LEASES, *chunk)
        redis_client().hdel(BUSY, *chunk)


def renew_leases(node_ids: list[str], at: datetime) -> None:
    """Every node heartbeat at `at` (one ZADD: what `lease_renew` writes, in bulk)."""
    from controlplane.common.redis_client import redis_client
    from controlplane.nodes.liveness import LEASES

    redis_client().zadd(LEASES, {node_id: at.timestamp() for node_id in node_ids})


def submit_jobs(count: int) -> list[str]:
    from django.contrib.auth import get_user_model

    from controlplane.jobs.services import job_start, job_submit

    user = get_user_model().objects.get(username=BENCH_USER)
    return [str(job_start(job=job_submit(owner=user, **JOB)).id) for _ in range(count)]


def settle_running(job_ids: list[str], now: datetime) -> None:
    """Half the placed jobs as a driver leaves them: running under a live lease, every stage ready."""
    from arceus.contracts.observed import ObservedState
    from arceus.contracts.status import JobStatus
    from controlplane.jobs.models import Job, Stage

    running = job_ids[::2]
    Job.objects.filter(pk__in=running).update(
        status=JobStatus.RUNNING, driver_lease_owner="bench-driver", driver_lease_expires_at=now + timedelta(days=1)
    )
    for job in Job.objects.filter(pk__in=running).only("id", "generation"):
        Stage.objects.filter(job=job, active=True).update(
            observed_generation=job.generation, observed_state=ObservedState.READY
        )


class PhaseTimer:
    """Wall time of the read, plan and apply calls `reconcile_once` makes (wrapped where it looks them up)."""

    def __init__(self) -> None:
        from controlplane.controller import executor

        self.spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        for phase, name in zip(PHASES, ("load_snapshot", "plan", "execute"), strict=True):
            setattr(executor, name, self._timed(phase, getattr(executor, name)))

    def _timed(self, phase: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[phase] += time.perf_counter() - start

        return timed

    def reset(self) -> None:
        self.spent = dict.fromkeys(PHASES, 0.0)


@contextmanager
def database_cpu() -> Iterator[list[float]]:
    """CPU seconds the database server's backend of this process's connection spent in the block (NaN if its
    process cannot be read)."""
    import psutil
    from django.db import connection

    out: list[float] = [float("nan")]
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            process = psutil.Process(cursor.fetchone()[0])
        before = sum(process.cpu_times()[:2])
    except (psutil.Error, Exception):  # not PostgreSQL on this machine, or not readable
        process = None
    yield out
    if process is not None:
        out[0] = sum(process.cpu_times()[:2]) - before


def run_pass(timer: PhaseTimer) -> dict[str, Any]:
    from controlplane.controller.executor import reconcile_once

    timer.reset()
    with database_cpu() as db_cpu:
        wall, cpu = time.perf_counter(), time.process_time()
        report = reconcile_once()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall": wall, "cpu": cpu, "db_cpu": db_cpu[0], **timer.spent, "applied": report.applied,
            "skipped": report.skipped}


def summary(passes: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"passes": len(passes)}
    for key in ("wall", "cpu", "db_cpu", *PHASES):
        values = [p[key] for p in passes]
        out[f"{key}_median_s"] = round(statistics.median(values), 4)
        out[f"{key}_max_s"] = round(max(values), 4)
    out["actions_applied"] = sum(len(p["applied"]) for p in passes)
    out["actions_skipped"] = sum(len(p["skipped"]) for p in passes)
    return out


def hosting_nodes() -> list[str]:
    from controlplane.jobs.models import Stage

    rows = Stage.objects.filter(active=True, node__isnull=False, job__owner__username=BENCH_USER)
    return sorted(str(n) for n in rows.values_list("node_id", flat=True))


def place_all(timer: PhaseTimer, fleet: list[str], expected_stages: int, limit: int = 200) -> list[dict[str, Any]]:
    """Passes (leases renewed before each) until `expected_stages` of the bench's stages are placed."""
    passes = []
    for _ in range(limit):
        renew_leases(fleet, datetime.now(UTC))
        passes.append(run_pass(timer))
        if len(hosting_nodes()) >= expected_stages:
            return passes
    raise SystemExit(f"placed {len(hosting_nodes())} of {expected_stages} stages in {limit} passes: see the log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=1_000, help="placed jobs of 3 stages (the steady state)")
    parser.add_argument("--passes", type=int, default=15, help="steady passes timed (of each kind)")
    parser.add_argument("--heartbeat-interval", type=float, default=10.0,
                        help="seconds between an agent's heartbeats: a steady pass follows nodes/interval renewals "
                             "(10,000 agents every 10 s: the 1,000 heartbeats/s of a second's pass)")
    parser.add_argument("--grace", type=float, default=30.0, help="ARCEUS_NODE_GRACE_SECONDS, above the interval")
    parser.add_argument("--silent", type=int, default=5, help="nodes hosting a stage that go silent per silent pass")
    parser.add_argument("--silent-passes", type=int, default=5)
    parser.add_argument("--new-jobs", type=int, default=100, help="jobs submitted at once for the placing passes")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        parser.error("set DATABASE_URL to a PostgreSQL database (and REDIS_URL): SQLite cannot hold this fleet")
    if args.nodes < 3 * (args.jobs + args.new_jobs) + args.silent * args.silent_passes:
        parser.error("--nodes must hold 3 stages of every job and --new-jobs, and the silent nodes' replacements")
    _setup_django(args.grace)
    from django.conf import settings

    garbage_collector_tuned()  # as the control worker's pool process runs (controlplane/celery.py)

    started = time.perf_counter()
    fleet = make_fleet(args.nodes, datetime.now(UTC))
    submit_jobs(args.jobs)
    timer = PhaseTimer()
    place_all(timer, fleet, 3 * args.jobs)
    settle_running(sorted({j for j in _bench_jobs()}), datetime.now(UTC))
    setup_s = time.perf_counter() - started
    renew_leases(fleet, datetime.now(UTC))
    run_pass(timer)  # warm: the placements' conditions settle, caches (if any) fill

    steady, everyone, renewed, turn = [], [], [], 0
    last = time.perf_counter()
    for _ in range(args.passes):
        # The agents whose heartbeat came since the previous pass (one a second at the least, as beat runs them),
        # in turn: all heartbeat every `--heartbeat-interval` seconds however long a pass takes.
        elapsed, last = max(1.0, time.perf_counter() - last), time.perf_counter()
        due = min(len(fleet), round(len(fleet) * elapsed / args.heartbeat_interval))
        renew_leases([fleet[(turn + k) % len(fleet)] for k in range(due)], datetime.now(UTC))
        turn, renewed = turn + due, [*renewed, due]
        steady.append(run_pass(timer))
    for _ in range(args.passes):  # the worst case: every agent heartbeat since the previous pass
        renew_leases(fleet, datetime.now(UTC))
        everyone.append(run_pass(timer))

    silent, moved = [], 0
    grace = settings.ARCEUS_NODE_GRACE_SECONDS
    for round_ in range(args.silent_passes):
        hosts = hosting_nodes()
        if not hosts:
            raise SystemExit("no stage is placed any more: the steady passes lost them (see the log)")
        victims = hosts[round_ * 97 % len(hosts):][: args.silent]
        now = datetime.now(UTC)
        renew_leases(fleet, now)
        renew_leases(victims, now - timedelta(seconds=grace + 5))
        before = set(hosting_nodes())
        silent.append(run_pass(timer))
        moved += len(set(victims) & before - set(hosting_nodes()))

    new_jobs_at = time.perf_counter()
    submit_jobs(args.new_jobs)
    submit_s = time.perf_counter() - new_jobs_at
    placing = place_all(timer, fleet, 3 * (args.jobs + args.new_jobs))

    result = {
        "nodes": args.nodes, "jobs": args.jobs, "setup_s": round(setup_s, 1),
        "max_placements_per_pass": settings.ARCEUS_MAX_PLACEMENTS_PER_PASS,
        "steady": {**summary(steady), "renewed_per_pass": round(statistics.median(renewed))},
        "steady_all_renewed": summary(everyone),
        "silent": {**summary(silent), "silent_per_pass": args.silent, "stages_moved": moved},
        "placing": {**summary(placing), "new_jobs": args.new_jobs, "submit_s": round(submit_s, 2)},
        "load_average": [round(x, 1) for x in os.getloadavg()],
    }
    print_and_write(result, write=not args.no_write)


def _bench_jobs() -> list[str]:
    from controlplane.jobs.models import Job

    return [str(j) for j in Job.objects.filter(owner__username=BENCH_USER).values_list("id", flat=True)]


def print_and_write(r: dict[str, Any], *, write: bool) -> None:
    def row(name: str, s: dict[str, Any]) -> str:
        return (f"| {name} | {s['passes']} | {s['wall_median_s']} / {s['wall_max_s']} | {s['cpu_median_s']} | "
                f"{s['db_cpu_median_s']} | {s['read_median_s']} / {s['plan_median_s']} / {s['apply_median_s']} | "
                f"{s['actions_applied']} |")

    lines = [
        f"{r['nodes']:,} registered Ready nodes, {r['jobs']:,} placed jobs of 3 stages (half placing, half running), "
        f"one `reconcile_once` at a time in-process (load average at the end {r['load_average']}).",
        "",
        "| pass | passes | wall median / max s | CPU median s | database CPU median s | read / plan / apply "
        "median s | actions applied |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        row(f"steady: nothing changed but {r['steady']['renewed_per_pass']:,} leases renewed (median)", r["steady"]),
        row("steady, every lease renewed since the previous pass", r["steady_all_renewed"]),
        row(f"{r['silent']['silent_per_pass']} nodes silent ({r['silent']['stages_moved']} stages moved in all)",
            r["silent"]),
        row(f"{r['placing']['new_jobs']} new jobs (at most {r['max_placements_per_pass']} placed a pass)",
            r["placing"]),
        "",
        "Goal: a steady pass well under 1 s (aim 0.3 s), a pass with silent nodes under 1 s.",
    ]
    body = "\n".join(lines)
    report("reconcile-pass", "Reconcile pass at scale (`bench/reconcile_pass.py`)", body, r, write=write)


if __name__ == "__main__":
    main()
