"""What recording a running job's progress costs the control plane: CPU, queries and database time per job report
(one step, its 3 stages' counters billed to the ledger, their time per step and the node speeds it gives, the lease
renewed), as the code before the batched path recorded it and as it records it now, side by side in one run.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/progress_writes.py \
        [--jobs 100] [--rounds 6] [--before 37f01b8] [--no-write]

The database and Redis the URLs name are filled directly (the bench's own user and everything it owns are dropped
first): 9 x `--jobs` Ready nodes made in bulk as bench/reconcile_pass.py makes them, 3 x `--jobs` jobs of 3 stages
submitted and started through the services and placed by reconcile passes, then made running under a driver lease.
Each way of recording gets `--jobs` of those jobs of its own (fresh ledgers) and records `--rounds` reports per job,
each round a step later and 10 s later (the agents' interval); the first round (each job's first entries) is not
counted. The ways:
- before: `job_record_steps` once per report, as the code at `--before` (this tree's history: exported to a
  temporary directory, where this script runs again in a process of its own against the same database);
- one at a time: `job_record_steps` once per report, as this tree records it (a batch of one);
- batched: each round's reports in one `jobs_record_progress` (as the stand-in drivers of
  bench/control_plane_scale.py write them).
Measured per report: this process's CPU (what a control-plane worker spends), its wall time, the queries it sent
(counted by a Django execute wrapper) and the CPU of the database server's backend serving this process's connection.
The machine is shared: CPU times hold better than wall times. Prints a table, writes docs/BENCHMARKS.md's section,
and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCH_USER = "progress-bench"
DRIVER = "progress-bench-driver"
JOB: dict[str, Any] = {
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32},
    "stages": 3,
    "requirements": {"owner_diversity": False},  # every node here is the bench user's
}
BEFORE = "37f01b8"  # main before the batched path (each report: 35 queries for a job of 3 stages)
WAYS = ("before", "one at a time", "batched")


def _setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()


def make_jobs(count: int) -> list[str]:
    """`count` running jobs of 3 stages placed on nodes of their own, under the lease of DRIVER; their ids."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection

    from arceus.contracts.status import JobStatus
    from bench.reconcile_pass import forget_leases, renew_leases
    from controlplane.controller.executor import reconcile_once
    from controlplane.jobs.models import Job, Stage, StageContribution
    from controlplane.jobs.services import job_start, job_submit
    from controlplane.market.models import LedgerEntry
    from controlplane.nodes.models import Node, NodeLease, Reachability, ReadyStatus
    from controlplane.nodes.services import _node_token_new, node_token_hash

    user_model = get_user_model()
    # A previous run's: what its progress billed PROTECTs its nodes and jobs (one DELETE each, in SQL).
    jobs = Job.objects.filter(owner__username=BENCH_USER).values("pk")
    for model in (LedgerEntry, StageContribution):
        sql, params = jobs.query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {model._meta.db_table} WHERE job_id IN ({sql})", params)  # noqa: S608
    forget_leases([str(i) for i in Node.objects.filter(owner__username=BENCH_USER).values_list("id", flat=True)])
    user_model.objects.filter(username=BENCH_USER).delete()
    user = user_model.objects.create_user(username=BENCH_USER, password=None)
    now = datetime.now(UTC)
    nodes = Node.objects.bulk_create(
        [
            Node(
                owner=user,
                name=f"bench-{i}",
                token_hash=node_token_hash(_node_token_new()),
                device_type="cpu",
                device_name="simulated",
                memory_bytes=8 << 30,
                flops_fp32=1e11,
                grpc_address=f"127.0.0.1:{i}",
                registered_at=now,
                ready_status=ReadyStatus.TRUE,
                ready_reason="Heartbeat",
                ready_transition_at=now,
                reachability=Reachability.RELAYED,
            )
            for i in range(3 * count)
        ],
        batch_size=2000,
    )
    NodeLease.objects.bulk_create(
        [NodeLease(node=n, renewed_at=now, duration_seconds=settings.ARCEUS_NODE_GRACE_SECONDS) for n in nodes],
        batch_size=2000,
    )
    fleet = [str(n.id) for n in nodes]
    ids = [str(job_start(job=job_submit(owner=user, **JOB)).id) for _ in range(count)]
    for _ in range(count):  # ARCEUS_MAX_PLACEMENTS_PER_PASS a pass
        if Stage.objects.filter(job_id__in=ids, active=True, node__isnull=False).count() == 3 * count:
            break
        renew_leases(fleet, datetime.now(UTC))
        reconcile_once()
    else:
        raise SystemExit("the bench's jobs were not all placed: see the log")
    Job.objects.filter(pk__in=ids).update(
        status=JobStatus.RUNNING, driver_lease_owner=DRIVER, driver_lease_expires_at=now + timedelta(days=1)
    )
    return ids


def report_of(job_id: str, step: int) -> tuple[Any, list[Any], list[Any]]:
    """A job's report of step `step`: the step, its stages' cumulative counters, their time per step (the types of
    the code this process runs)."""
    from arceus.contracts.counters import StageCounters
    from arceus.training.plan import StageTiming
    from controlplane.driver.progress import StepPoint

    batch = JOB["dataset_config"]["batch_size"]
    point = StepPoint(
        epoch=step // 50, step=step, total_steps=10_000, loss=2.3 / (1 + step / 100), samples_per_second=320.0
    )
    counters = [
        StageCounters(
            index=i,
            samples=batch * step,
            micro_batches=4 * step,
            compute_seconds=0.02 * step,
            bytes_sent=40_000 * step,
            bytes_received=40_000 * step,
        )
        for i in range(JOB["stages"])
    ]
    timings = [StageTiming(i, 0.02, 0.01, 0.1, samples=batch, micro_batches=4) for i in range(JOB["stages"])]
    return point, counters, timings


def measure(way: str, job_ids: list[str], rounds: int, start: datetime) -> dict[str, Any]:
    """Record `rounds` reports of each job (round r at `start` + 10 r s) the given way; the costs of rounds 2 on, per
    report."""
    import psutil
    from django.db import connection

    queries = [0]

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        queries[0] += 1
        return execute(sql, params, many, context)

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = psutil.Process(cursor.fetchone()[0])
    record = _recorder(way)
    cpu = wall = db_cpu = 0.0
    counted = 0
    for step in range(1, rounds + 1):
        reports = [(job_id, *report_of(job_id, step)) for job_id in job_ids]
        now = start + timedelta(seconds=10 * step)
        queries[0], db_before = 0, sum(backend.cpu_times()[:2])
        began_cpu, began_wall = time.process_time(), time.perf_counter()
        with connection.execute_wrapper(count):
            held = record(reports, now)
        if not all(held):
            raise SystemExit(f"{way}: {held.count(False)} reports found their lease gone")
        if step > 1:
            cpu += time.process_time() - began_cpu
            wall += time.perf_counter() - began_wall
            db_cpu += sum(backend.cpu_times()[:2]) - db_before
            counted += queries[0]
    per = len(job_ids) * (rounds - 1)
    return {
        "reports": per,
        "cpu_ms": round(cpu / per * 1e3, 3),
        "wall_ms": round(wall / per * 1e3, 3),
        "queries": round(counted / per, 2),
        "db_cpu_ms": round(db_cpu / per * 1e3, 3),
    }


def _recorder(way: str) -> Any:
    from controlplane.driver.progress import job_record_steps

    def one_at_a_time(reports: list[tuple[Any, ...]], now: datetime) -> list[bool]:
        return [
            job_record_steps(
                job_id=job_id, lease_owner=DRIVER, points=[point], now=now, stages=counters, timings=timings
            )
            for job_id, point, counters, timings in reports
        ]

    if way != "batched":
        return one_at_a_time
    from controlplane.driver.recording import ProgressReport, jobs_record_progress

    def batched(reports: list[tuple[Any, ...]], now: datetime) -> list[bool]:
        return jobs_record_progress(
            reports=[
                ProgressReport(job_id=job_id, lease_owner=DRIVER, points=[point], stages=counters, timings=timings)
                for job_id, point, counters, timings in reports
            ],
            now=now,
        )

    return batched


def measure_before(rev: str, job_ids: list[str], rounds: int, start: datetime) -> dict[str, Any]:
    """`measure` of the "before" way in the code at `rev`: its tree exported, its stubs generated, this script run
    there against the same database."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="progress-before-") as tree:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        env = {**os.environ, "PYTHONPATH": tree}
        subprocess.run([sys.executable, "protos/generate.py"], cwd=tree, env=env, check=True, capture_output=True)
        script = Path(tree) / "bench" / Path(__file__).name
        script.write_text(Path(__file__).read_text())
        done = subprocess.run(
            [
                sys.executable,
                str(script),
                "--measure-before",
                json.dumps({"jobs": job_ids, "rounds": rounds, "start": start.isoformat()}),
            ],
            cwd=tree,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100, help="running jobs of 3 stages recorded each way")
    parser.add_argument("--rounds", type=int, default=6, help="reports per job (the first is not counted)")
    parser.add_argument("--before", default=BEFORE, help="the commit whose per-report recording is 'before'")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    parser.add_argument("--measure-before", help=argparse.SUPPRESS)  # the subprocess of `measure_before`
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        parser.error("set DATABASE_URL to a PostgreSQL database (and REDIS_URL)")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the first round is not counted")
    _setup_django()
    from controlplane.common.garbage_collector import garbage_collector_tuned

    garbage_collector_tuned()  # as the control worker's pool process runs (controlplane/celery.py)
    if args.measure_before:
        given = json.loads(args.measure_before)
        print(json.dumps(measure("before", given["jobs"], given["rounds"], datetime.fromisoformat(given["start"]))))
        return
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    ids = make_jobs(3 * args.jobs)
    start = datetime.now(UTC)
    results = {"before": measure_before(args.before, ids[: args.jobs], args.rounds, start)}
    for k, way in enumerate(WAYS[1:], start=1):
        results[way] = measure(way, ids[k * args.jobs : (k + 1) * args.jobs], args.rounds, start)
    result = {
        "jobs": args.jobs,
        "rounds": args.rounds,
        "before_commit": args.before,
        **results,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print_and_write(result, write=not args.no_write)


def print_and_write(r: dict[str, Any], *, write: bool) -> None:
    from bench.report import report

    def row(way: str, name: str) -> str:
        w = r[way]
        cores = 100 * w["cpu_ms"] / 1e3  # 1,000 jobs reporting every 10 s
        return (
            f"| {name} | {w['cpu_ms']:.2f} | {w['queries']:.2f} | {w['db_cpu_ms']:.2f} | {w['wall_ms']:.2f} | "
            f"{cores:.2f} |"
        )

    lines = [
        f"{r['jobs']} running jobs of 3 stages recorded each way, {r['rounds'] - 1} reports each counted (a step, 3 "
        f"stages' counters billed, their times and node speeds); in-process against PostgreSQL on this machine (load "
        f"average at the end {r['load_average']}).",
        "",
        "| way | CPU ms per report | queries per report | database CPU ms per report | wall ms per report | "
        "CPU cores for 1,000 jobs every 10 s |",
        "| --- | --- | --- | --- | --- | --- |",
        row("before", f"before: `job_record_steps` per report at {r['before_commit']}"),
        row("one at a time", "`job_record_steps` per report (a batch of one)"),
        row("batched", f"`jobs_record_progress`, {r['jobs']} reports a batch"),
    ]
    report("progress-writes", "Recording progress (`bench/progress_writes.py`)", "\n".join(lines), r, write=write)


if __name__ == "__main__":
    main()
