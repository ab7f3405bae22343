"""`make demo`: the whole system on one machine, training the main job end to end.

Starts the control plane (SQLite, gunicorn), Celery workers and beat on an embedded Redis (or
`REDIS_URL`), and three node agents, each its own process on loopback; submits an MLP on the
bundled digits data split into three pipeline stages, one per agent; draws a progress bar; and
prints one JSON summary as its last stdout line. Ctrl-C stops every child process. With `--keep` it then
prints the dashboard's URL and a login, and keeps everything serving until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arceus.progress_bar import JobProgressBar
from devtools.cluster import LocalCluster

DEMO_USER, DEMO_PASSWORD = "demo", "arceus-demo"  # the account the demo submits with: the dashboard's login
DEMO_JOB: dict[str, Any] = {
    "name": "digits-mlp-3-stages",
    "model_config": {"type": "mlp", "layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 10,
    "learning_rate": 0.05,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 4,
    "seed": 0,
    "stages": 3,
    "requirements": {"owner_diversity": False},  # the demo's three agents are one owner's
}


def summarize(detail: dict[str, Any]) -> dict[str, Any]:
    return {
        "job_id": str(detail["id"]),
        "status": detail["status"],
        "steps": detail["step"],
        "final_loss": detail["final_loss"],
        "val_accuracy": detail["val_accuracy"],
        "nodes": [
            {
                "node_id": str(p["node_id"]),
                "stage": p["stage_index"],
                "layers": list(range(p["layer_start"], p["layer_end"])),
                "samples": p["samples"],
                "compute_seconds": round(p["compute_seconds"], 3),
                "bytes_sent": p["bytes_sent"],
                "bytes_received": p["bytes_received"],
            }
            for p in detail["placements"]
        ],
    }


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=3, help="node agents to start (default 3)")
    parser.add_argument("--epochs", type=int, default=DEMO_JOB["epochs"])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the SQLite file and logs go (default: a new temporary directory)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the job")
    parser.add_argument("--keep", action="store_true",
                        help="after the job, print the dashboard's URL and login and keep serving until Ctrl-C")
    args = parser.parse_args(argv)
    if args.agents < 1:
        parser.error("--agents must be at least 1")

    signal.signal(signal.SIGTERM, _raise_interrupt)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="arceus-demo-"))
    cluster = LocalCluster(workdir=workdir, redis_url=os.environ.get("REDIS_URL"),
                           database_url=os.environ.get("DATABASE_URL"))
    bar = JobProgressBar(file=sys.stderr)
    try:
        print_status(f"work directory {workdir} (logs in {workdir / 'logs'})")
        cluster.start(username=DEMO_USER, password=DEMO_PASSWORD)
        print_status(f"control plane at {cluster.api_url} (API docs: {cluster.api_url}/api/docs/)")
        for agent in cluster.start_agents([f"agent-{index}" for index in range(args.agents)]):
            print_status(f"node agent {agent.name}: gRPC {agent.grpc_address}, "
                         f"metrics http://{agent.metrics_address}/metrics?token={agent.metrics_token}")
        job = cluster.client.submit_job({**DEMO_JOB, "epochs": args.epochs,
                                         "stages": min(args.agents, DEMO_JOB["stages"])})
        print_status(f"submitted job {job['id']}; training")
        cluster.client.start_job(job["id"])
        started = time.monotonic()
        detail = cluster.client.wait(job["id"], timeout=args.timeout, on_update=bar.update)
        bar.close()
        summary = summarize(detail)
        print_status(f"job {detail['status']} in {time.monotonic() - started:.1f}s: val accuracy "
            f"{detail['val_accuracy']}, final loss {detail['final_loss']}")
        if detail["status"] != "succeeded":
            print_status(f"job error: {detail.get('error')}")
        print(json.dumps(summary), flush=True)
        code = 0 if detail["status"] == "succeeded" else 1
        if args.keep:
            keep_serving(cluster.api_url)
        return code
    except KeyboardInterrupt:
        bar.close()
        print_status("interrupted: stopping every process")
        return 130
    finally:
        cluster.stop()


def keep_serving(api_url: str) -> None:
    """Until Ctrl-C (or SIGTERM): everything keeps running for a look at the dashboard."""
    # localhost, not 127.0.0.1: browsers keep the (Secure) session cookie over plain HTTP only there.
    dashboard = api_url.replace("127.0.0.1", "localhost") + "/dashboard/"
    print_status(f"dashboard: {dashboard} (log in as {DEMO_USER}, password {DEMO_PASSWORD}); Ctrl-C stops it all")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print_status("stopping every process")


def print_status(message: str) -> None:
    print(f"[arceus demo] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
