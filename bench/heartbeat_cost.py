"""What a heartbeat that changes nothing costs the web server: CPU seconds of the gunicorn processes per heartbeat,
for agents that host nothing and for agents that host a stage (and report it in every heartbeat).

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/heartbeat_cost.py \
        [--agents 1000] [--jobs 100] [--heartbeats 20000] [--connections 32] [--no-write]

The control plane is a whole deployment on this machine (devtools.cluster.LocalCluster: gunicorn as configured by
controlplane/gunicorn_conf.py, the Celery workers and beat). `--agents` nodes are minted and registered as in
bench/control_plane_scale.py and heartbeat once (Ready, and the assignments version each holds); then `--jobs`
3-stage jobs are placed on them, and each agent hosting a stage reports it `ready` in every heartbeat, as a real
agent does (arceus.contracts.observed), until the reports are recorded and the assignments settle. The load
generator (aiohttp coroutines of this process, keep-alive connections) then sends `--heartbeats` heartbeats
round-robin over the agents of a kind, each sending back the version it holds and its unchanged reports, as fast as
`--connections` connections carry them: once as an agent sends them (answered before Django where the quiet path
may, controlplane/agents/heartbeat.py), then the same bodies through the API view (their content type spelled
`application/json;charset=utf-8`, which the quiet path declines and DRF parses as JSON, so the same heartbeat
changes nothing and gets the same answer through Django and DRF). Why the quiet path handed heartbeats to Django is
read from /metrics around each measurement.

Measured: the user + system CPU time of the web server's processes (master and workers, from /proc/PID/stat
through psutil) over those heartbeats, divided by their number. CPU time, not latency: the machine is shared, so
wall-clock figures say more about the neighbours than about the heartbeat. Prints the figures, writes
docs/BENCHMARKS.md's heartbeat-cost section, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.control_plane_scale import (  # noqa: E402
    JOB,
    SimAgent,
    _setup_django,
    heartbeats_to_django,
    make_nodes,
    placed_nodes,
    register,
    submit_jobs,
)
from bench.report import report  # noqa: E402
from devtools.cluster import LocalCluster  # noqa: E402

JSON = "application/json"
THROUGH_API = "application/json;charset=utf-8"  # JSON to DRF; a spelling the quiet path leaves to Django
SETTLE_TIMEOUT_S = 120.0


async def beat(session: aiohttp.ClientSession, url: str, agent: SimAgent, reports: dict[str, list[dict[str, Any]]],
               *, through_api: bool = False) -> tuple[int, bool]:
    """One heartbeat of `agent`, reporting each stage its assignments name ready (`reports`, by node, kept from the
    assignments answered): (status, whether new assignments came)."""
    body = json.dumps({"observed": reports.get(agent.node_id, []), "assignments_version": agent.version}).encode()
    headers = {"Authorization": f"Node {agent.token}", "Content-Type": THROUGH_API if through_api else JSON}
    async with session.post(f"{url}/api/agent/heartbeat", data=body, headers=headers) as response:
        answer = await response.json(content_type=None)
        if response.status != 200:
            return response.status, False
        agent.version = answer["assignments_version"]
        if "assignments" in answer:
            reports[agent.node_id] = [{"stage_id": a["stage_id"], "generation": a["generation"], "state": "ready",
                                       "message": ""} for a in answer["assignments"]]
        return response.status, "assignments" in answer


def web_cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


async def placed(jobs: int) -> set[str]:
    """The nodes hosting a stage of the bench's jobs once all `jobs` are placed (polled each second)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while len(hosts := await asyncio.to_thread(placed_nodes)) < jobs * JOB["stages"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(hosts)} of {jobs * JOB['stages']} stages placed in {SETTLE_TIMEOUT_S:g} s")
        await asyncio.sleep(1.0)
    return set(hosts)


async def measure(cluster: LocalCluster, agents: list[SimAgent], args: argparse.Namespace) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=args.connections)
    reports: dict[str, list[dict[str, Any]]] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        gate = asyncio.Semaphore(args.connections)

        async def gated(coroutine: Any) -> Any:
            async with gate:
                return await coroutine

        async def round_of(some: list[SimAgent]) -> list[tuple[int, bool]]:
            return await asyncio.gather(*(gated(beat(session, cluster.api_url, a, reports)) for a in some))

        await asyncio.gather(*(gated(register(session, cluster.api_url, a, i))
                               for i, a in enumerate(agents)))
        # Twice: the first makes the nodes Ready and hands out their assignments; the second is a quiet one already.
        for _ in range(2):
            await round_of(agents)
        await asyncio.to_thread(submit_jobs, args.jobs)
        hosts = await placed(args.jobs)
        hosting = [a for a in agents if a.node_id in hosts]
        idle = [a for a in agents if a.node_id not in hosts]
        # Until the hosting agents' reports are recorded and the jobs' assignments settle (all stages ready: each
        # job starts, its driver enqueued; no training worker runs here): a round with no new assignments, twice.
        deadline, settled = time.monotonic() + SETTLE_TIMEOUT_S, 0
        while settled < 2:
            answers = await round_of(hosting)
            settled = settled + 1 if all(status == 200 and not new for status, new in answers) else 0
            if time.monotonic() > deadline:
                raise RuntimeError(f"the hosting agents' assignments did not settle: {answers[:5]}")
            await asyncio.sleep(1.0)
        await round_of(idle)
        await asyncio.sleep(2.0)  # the registrations' dial-backs are over
        pids = cluster.process_ids("web")
        statuses: dict[int, int] = {}

        async def cpu_per_beat(some: list[SimAgent], through_api: bool) -> tuple[float, float, dict[str, float]]:
            """(web CPU seconds, wall seconds) per heartbeat over `--heartbeats` of them, and the heartbeats the
            quiet path handed to Django meanwhile, by reason."""
            queue = iter(range(args.heartbeats))

            async def worker() -> None:
                for i in queue:
                    status, _ = await beat(session, cluster.api_url, some[i % len(some)], reports,
                                           through_api=through_api)
                    statuses[status] = statuses.get(status, 0) + 1

            handed = await heartbeats_to_django(session, cluster)
            cpu_before, started = web_cpu_seconds(pids), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.connections)))
            wall, cpu = time.perf_counter() - started, web_cpu_seconds(pids) - cpu_before
            after = await heartbeats_to_django(session, cluster)
            to_django = {k: v - handed.get(k, 0) for k, v in after.items() if v != handed.get(k, 0)}
            return cpu / args.heartbeats, wall / args.heartbeats, to_django

        rows = {f"{kind}_{path}": await cpu_per_beat(some, through_api=path == "api")
                for kind, some in (("idle", idle), ("hosting", hosting)) for path in ("quiet", "api")}
    return {
        "agents": len(agents), "hosting_agents": len(hosting), "jobs": args.jobs, "heartbeats": args.heartbeats,
        "connections": args.connections, "statuses": {str(k): v for k, v in statuses.items()},
        **{f"{row}_web_cpu_ms": round(cpu * 1e3, 3) for row, (cpu, _, _) in rows.items()},
        **{f"{row}_per_s_wall": round(1 / wall) for row, (_, wall, _) in rows.items()},
        **{f"{row}_to_django": {k: int(v) for k, v in handed.items()} for row, (_, _, handed) in rows.items()},
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=100, help="3-stage jobs placed on the agents")
    parser.add_argument("--heartbeats", type=int, default=20_000, help="heartbeats measured of each kind")
    parser.add_argument("--connections", type=int, default=32, help="the load generator's keep-alive connections")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        parser.error("set DATABASE_URL to a PostgreSQL database (and REDIS_URL)")
    if args.jobs * JOB["stages"] >= args.agents:
        parser.error("--jobs places 3 stages each: leave agents that host nothing")
    with tempfile.TemporaryDirectory(prefix="arceus-heartbeat-") as workdir:
        cluster = LocalCluster(Path(workdir), database_url=os.environ["DATABASE_URL"],
                               redis_url=os.environ.get("REDIS_URL"), heartbeat_interval_seconds=10.0,
                               reconcile_interval_seconds=1.0,
                               # Each row's agents are silent while the others' rows are measured (a minute or
                               # more): a lease that ran out then would move stages in the middle of a row.
                               extra_env={"ARCEUS_LOG_LEVEL": "WARNING", "ARCEUS_NODE_GRACE_SECONDS": "600",
                                          # One owner's fleet registering from one address at once.
                                          "ARCEUS_THROTTLE_AGENT_REGISTER_OWNER": f"{args.agents}/min",
                                          "ARCEUS_THROTTLE_AGENT_REGISTER_ADDRESS": f"{args.agents}/min"})
        cluster.start()
        try:
            cluster.crash("worker-training")  # no job trains here: a started job's driver waits in its queue
            _setup_django(cluster.env)
            agents = make_nodes(args.agents)
            result = asyncio.run(measure(cluster, agents, args))
        finally:
            cluster.stop()
    r = result

    def row(name: str, kind: str) -> str:
        handed = r[f"{kind}_to_django"] or "none"
        return (f"| {name} | {r[f'{kind}_web_cpu_ms']} ms | {r[f'{kind}_per_s_wall']:,} | {handed} |\n")

    body = (
        f"{r['agents']:,} registered agents, {r['hosting_agents']:,} of them hosting a stage of {r['jobs']} placed "
        f"3-stage jobs (all stages reported ready, the jobs started; no training worker runs), "
        f"{r['connections']} keep-alive connections, {r['heartbeats']:,} heartbeats of each row that change nothing "
        f"(assignments unchanged; a hosting agent's stage reported as recorded); CPU time (user + system) of "
        f"gunicorn's processes per heartbeat. Load average at the end {r['load_average']}: the machine is shared, so "
        f"CPU time, not latency, is the figure; the rows are taken in one run, side by side.\n\n"
        f"| heartbeat | web CPU per heartbeat | heartbeats/s (wall, this machine) | handed to Django (reason) |\n"
        f"| --- | --- | --- | --- |\n"
        + row("hosting nothing, as agents send it (answered before Django, controlplane/agents/heartbeat.py)",
              "idle_quiet")
        + row("hosting nothing, the same through Django and DRF (the API view)", "idle_api")
        + row("hosting a stage, its report unchanged, as agents send it", "hosting_quiet")
        + row("hosting a stage, the same through Django and DRF (every such heartbeat's path before it was judged "
              "on the quiet path)", "hosting_api")
        + f"\nStatuses: {r['statuses']}. Command: `bench/heartbeat_cost.py {' '.join(sys.argv[1:])}`."
    )
    report("heartbeat-cost", "A heartbeat's cost (`bench/heartbeat_cost.py`)", body, result, write=not args.no_write)


if __name__ == "__main__":
    main()
