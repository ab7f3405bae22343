"""What a heartbeat that changes nothing costs the web server: CPU seconds of the gunicorn processes per heartbeat.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/heartbeat_cost.py \
        [--agents 1000] [--heartbeats 20000] [--connections 32] [--no-write]

The control plane is a whole deployment on this machine (devtools.cluster.LocalCluster: gunicorn as configured by
controlplane/gunicorn_conf.py, the Celery workers and beat). `--agents` nodes are minted and registered as in
bench/control_plane_scale.py and heartbeat once (Ready, and the assignments version each holds); then the load
generator (aiohttp coroutines of this process, keep-alive connections) sends `--heartbeats` heartbeats round-robin
over the agents, each sending back the version it holds, as fast as `--connections` connections carry them: once
quiet (answered before Django, controlplane/agents/heartbeat.py), then as many through the API view (the version
with a space after it: the quiet path declines it, DRF's serializer trims it, and nothing changes).

Measured: the user + system CPU time of the web server's processes (master and workers, from /proc/PID/stat
through psutil) over those heartbeats, divided by their number. CPU time, not latency: the machine is shared, so
wall-clock figures say more about the neighbours than about the heartbeat. Prints the figures, writes
docs/BENCHMARKS.md's heartbeat-cost section, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.control_plane_scale import SimAgent, _setup_django, make_nodes, register  # noqa: E402
from bench.report import report  # noqa: E402
from devtools.cluster import LocalCluster  # noqa: E402


async def beat(session: aiohttp.ClientSession, url: str, agent: SimAgent, *, through_api: bool = False) -> int:
    # Through the API: the version with a space after it, which the quiet path declines and the API's serializer
    # trims, so the same heartbeat changes nothing and gets the same answer through Django and DRF.
    body = {"observed": [], "assignments_version": agent.version + (" " if through_api else "")}
    async with session.post(f"{url}/api/agent/heartbeat", json=body,
                            headers={"Authorization": f"Node {agent.token}"}) as response:
        answer = await response.json(content_type=None)
        if response.status == 200:
            agent.version = answer["assignments_version"]
        return response.status


def web_cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


async def measure(cluster: LocalCluster, agents: list[SimAgent], args: argparse.Namespace) -> dict[str, Any]:
    from arceus.wire.tls import new_identity

    certificate = new_identity().certificate
    connector = aiohttp.TCPConnector(limit=args.connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        gate = asyncio.Semaphore(args.connections)

        async def gated(coroutine: Any) -> Any:
            async with gate:
                return await coroutine

        await asyncio.gather(*(gated(register(session, cluster.api_url, a, certificate, i))
                               for i, a in enumerate(agents)))
        # Twice: the first makes the nodes Ready and hands out their assignments; the second is a quiet one already.
        for _ in range(2):
            await asyncio.gather(*(gated(beat(session, cluster.api_url, a)) for a in agents))
        await asyncio.sleep(2.0)  # the registrations' dial-backs are over
        pids = cluster.process_ids("web")
        statuses: dict[int, int] = {}

        async def cpu_per_beat(through_api: bool) -> tuple[float, float]:
            """(web CPU seconds, wall seconds) per heartbeat over `--heartbeats` of them."""
            queue = iter(range(args.heartbeats))

            async def worker() -> None:
                for i in queue:
                    status = await beat(session, cluster.api_url, agents[i % len(agents)], through_api=through_api)
                    statuses[status] = statuses.get(status, 0) + 1

            cpu_before, started = web_cpu_seconds(pids), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.connections)))
            wall, cpu = time.perf_counter() - started, web_cpu_seconds(pids) - cpu_before
            return cpu / args.heartbeats, wall / args.heartbeats

        quiet_cpu, quiet_wall = await cpu_per_beat(through_api=False)
        api_cpu, api_wall = await cpu_per_beat(through_api=True)
    return {
        "agents": len(agents), "heartbeats": args.heartbeats, "connections": args.connections,
        "statuses": {str(k): v for k, v in statuses.items()},
        "web_cpu_ms_per_heartbeat": round(quiet_cpu * 1e3, 3),
        "heartbeats_per_web_cpu_second": round(1 / quiet_cpu),
        "api_web_cpu_ms_per_heartbeat": round(api_cpu * 1e3, 3),
        "quiet_heartbeats_per_s_wall": round(1 / quiet_wall), "api_heartbeats_per_s_wall": round(1 / api_wall),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--heartbeats", type=int, default=20_000, help="quiet heartbeats measured")
    parser.add_argument("--connections", type=int, default=32, help="the load generator's keep-alive connections")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        parser.error("set DATABASE_URL to a PostgreSQL database (and REDIS_URL)")
    with tempfile.TemporaryDirectory(prefix="arceus-heartbeat-") as workdir:
        cluster = LocalCluster(Path(workdir), database_url=os.environ["DATABASE_URL"],
                               redis_url=os.environ.get("REDIS_URL"), heartbeat_interval_seconds=10.0,
                               extra_env={"ARCEUS_LOG_LEVEL": "WARNING", "ARCEUS_NODE_GRACE_SECONDS": "30"})
        cluster.start()
        try:
            cluster.crash("worker-training")  # no job runs here
            _setup_django(cluster.env)
            agents = make_nodes(args.agents)
            result = asyncio.run(measure(cluster, agents, args))
        finally:
            cluster.stop()
    body = (
        f"{result['agents']:,} registered agents, {result['connections']} keep-alive connections, "
        f"{result['heartbeats']:,} heartbeats of each kind that change nothing (nothing to report, assignments "
        f"unchanged); CPU time (user + system) of gunicorn's processes per heartbeat. Load average at the end "
        f"{result['load_average']}: the machine is shared, so CPU time, not latency, is the figure; the two rows are "
        f"taken in one run, side by side.\n\n"
        f"| heartbeat | web CPU per heartbeat | heartbeats/s (wall, this machine) |\n"
        f"| --- | --- | --- |\n"
        f"| quiet, answered before Django (controlplane/agents/heartbeat.py) | "
        f"{result['web_cpu_ms_per_heartbeat']} ms | {result['quiet_heartbeats_per_s_wall']:,} |\n"
        f"| the same through Django and DRF (the API view) | {result['api_web_cpu_ms_per_heartbeat']} ms | "
        f"{result['api_heartbeats_per_s_wall']:,} |\n\n"
        f"Statuses: {result['statuses']}."
    )
    report("heartbeat-cost", "A quiet heartbeat's cost (`bench/heartbeat_cost.py`)", body, result,
           write=not args.no_write)


if __name__ == "__main__":
    main()
