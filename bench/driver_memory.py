"""The training worker's memory per running job: its resident memory with 0, 1, 4 and 8 small jobs training at once
on real agents, its drivers threads of one process (the shipped pool, controlplane/common/worker_pool.py) beside a
process per driver (Celery's prefork pool, as the training worker ran before).

    DATABASE_URL=postgres://... .venv/bin/python bench/driver_memory.py [--jobs 1,4,8] [--samples 5] \
        [--pools threads,prefork] [--no-write]

One deployment on this machine (devtools.cluster.LocalCluster: gunicorn, the Celery workers and beat on the database
DATABASE_URL names and an embedded redis-server) with 8 agents of one torch thread. Each job is a 1-stage digits MLP
[64, 128, 64, 10] (batch 32, 4 micro-batches) of more epochs than the bench waits for; a level of `--jobs` is reached
by starting jobs until that many run, each past its 5th step (its driver built its plan, its channel, its dataset and
its sink and writes progress). At each level (and with no job, first and after the jobs were cancelled) the worker's
processes are read `--samples` times a second apart: their RSS summed and their PSS summed (a page a fork shares
counted once), medians. The threads pool first, then the same agents with the training worker restarted as
`-P prefork -c 8` (one pool process per running job, 8 of them forked at start). Per running job: (the level of the
most jobs - no job) / its jobs, and the slope between the fewest and the most jobs. Prints a table, writes
docs/BENCHMARKS.md, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import report  # noqa: E402
from controlplane.common.worker_pool import TRAINING_WORKER_POOL  # noqa: E402
from devtools.cluster import LocalCluster  # noqa: E402

MIB = 1024 * 1024
AGENTS = 8
POOLS = {"threads": TRAINING_WORKER_POOL, "prefork": ("-P", "prefork", "-c", str(AGENTS))}
JOB: dict[str, Any] = {
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 1000,  # cancelled long before
    "learning_rate": 0.05,
    "micro_batches": 4,
    "stages": 1,
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}
WARM_STEP = 5
LABELS = {"0": "no job", "1": "1 job", "0 after": "no job, after"}


def worker_memory(cluster: LocalCluster, samples: int) -> dict[str, float]:
    """The training worker's processes' RSS and PSS summed, in MiB (medians of `samples` reads a second apart)."""
    rss, pss = [], []
    for i in range(samples):
        if i:
            time.sleep(1.0)
        infos = [psutil.Process(pid).memory_full_info() for pid in cluster.process_ids("worker-training")]
        rss.append(sum(m.rss for m in infos) / MIB)
        pss.append(sum(m.pss for m in infos) / MIB)
    return {"rss_mib": round(statistics.median(rss), 1), "pss_mib": round(statistics.median(pss), 1),
            "processes": len(cluster.process_ids("worker-training"))}


def start_jobs(cluster: LocalCluster, count: int, running: list[str]) -> None:
    """Start jobs until `count` train, each past its WARM_STEP."""
    while len(running) < count:
        job = cluster.client.submit_job({**JOB, "name": f"memory-{len(running)}", "seed": len(running)})
        cluster.client.start_job(job["id"])
        running.append(job["id"])
    for job_id in running:
        cluster.wait_for_job(job_id, lambda d: d["status"] == "running" and d["step"] >= WARM_STEP, 180)


def cancel_jobs(cluster: LocalCluster, running: list[str]) -> None:
    """Cancel every job and wait until its driver let its lease go (its thread or process is idle again)."""
    for job_id in running:
        cluster.client.cancel_job(job_id)
    for job_id in running:
        cluster.wait_for_job(job_id, lambda d: d["status"] == "cancelled", 120, give_up_on=("failed",))
    running.clear()
    time.sleep(5.0)  # a cancelled driver notices at its next write (every 0.5 s) and ends its task


def measure_pool(cluster: LocalCluster, name: str, levels: list[int], samples: int) -> dict[str, Any]:
    cluster.wait_for_worker("worker-training")
    rows = {"0": worker_memory(cluster, samples)}
    running: list[str] = []
    for count in levels:
        start_jobs(cluster, count, running)
        rows[str(count)] = worker_memory(cluster, samples)
    cancel_jobs(cluster, running)
    rows["0 after"] = worker_memory(cluster, samples)
    most, fewest = str(levels[-1]), str(levels[0])
    result: dict[str, Any] = {"levels": rows}
    for kind in ("rss", "pss"):
        key = f"{kind}_mib"
        result[f"{kind}_per_job_mib"] = round((rows[most][key] - rows["0"][key]) / levels[-1], 2)
        result[f"{kind}_slope_per_job_mib"] = round(
            (rows[most][key] - rows[fewest][key]) / max(1, levels[-1] - levels[0]), 2)
    print(name, result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="1,4,8", help="the levels of running jobs, at most 8")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--pools", default="threads,prefork", help="the pools measured, in this order")
    parser.add_argument("--no-write", dest="write", action="store_false")
    args = parser.parse_args()
    levels = sorted(int(n) for n in args.jobs.split(","))
    if levels[0] < 1 or levels[-1] > AGENTS:
        parser.error(f"--jobs: levels between 1 and {AGENTS}")
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        parser.error("set DATABASE_URL to a PostgreSQL database")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="arceus-driver-memory-") as workdir:
        cluster = LocalCluster(Path(workdir), database_url=os.environ["DATABASE_URL"], redis_url=None,
                               heartbeat_interval_seconds=1.0, reconcile_interval_seconds=1.0,
                               extra_env={"ARCEUS_LOG_LEVEL": "WARNING"})
        cluster.start()
        try:
            suffix = uuid.uuid4().hex[:6]  # nodes of an earlier run on this database keep their names
            cluster.start_agents([f"memory-{suffix}-{i}" for i in range(AGENTS)])
            pools = {}
            for name in args.pools.split(","):
                if list(cluster.training_pool) != list(POOLS[name]):
                    cluster.relaunch_training_worker(POOLS[name])
                pools[name] = measure_pool(cluster, name, levels, args.samples)
        finally:
            cluster.stop()
    result = {"pools": pools, "pool_options": {name: list(POOLS[name]) for name in pools},
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    print_and_write(result, levels, write=args.write)


def print_and_write(r: dict[str, Any], levels: list[int], *, write: bool) -> None:
    columns = ["0", *(str(n) for n in levels), "0 after"]
    lines = [
        f"`python bench/driver_memory.py`: {AGENTS} agents, 1-stage digits MLP jobs; load average "
        f"{r['load_average_before']} before, {r['load_average_after']} after (2 cores shared with other sessions).",
        "",
        "| training worker | " + " | ".join(LABELS.get(c, f"{c} jobs") for c in columns)
        + " | per running job | slope |",
        "| --- | " + " | ".join("---" for _ in columns) + " | --- | --- |",
    ]
    for name, p in r["pools"].items():
        pool = r["pool_options"][name]
        for kind in ("rss", "pss"):
            cells = [f"{p['levels'][c][f'{kind}_mib']:,} ({p['levels'][c]['processes']})" for c in columns]
            lines.append(f"| `{' '.join(pool)}`: {kind.upper()} MiB (processes) | " + " | ".join(cells)
                         + f" | {p[f'{kind}_per_job_mib']} MiB | {p[f'{kind}_slope_per_job_mib']} MiB |")
    report("driver-memory", "Drivers as threads of one worker (`bench/driver_memory.py`)", "\n".join(lines), r,
           write=write)


if __name__ == "__main__":
    main()
