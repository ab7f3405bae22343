"""Kill a random stage agent at a random step, over many trials: does every job still finish, how fast is
the loss detected and recovered, and how far does the result drift from an uninterrupted run?

    .venv/bin/python bench/fault_trials.py [--trials 10] [--seed 0] [--shaped [--delay-ms 20] [--rate-mbit 100]]

One whole deployment on this machine (as `make demo` starts it: control plane, Celery worker and beat,
node agents, each its own process; PostgreSQL and Redis by DATABASE_URL / REDIS_URL, else SQLite and an
embedded redis-server), default settings (heartbeat 2 s, node grace 6 s). Each trial trains the digits
MLP over 3 stages with one spare agent, SIGKILLs a random stage's agent once training passes a random
step, and measures:
- detection: kill -> the lost stage is placed on another node (the reconciler's decision);
- recovery: kill -> training is running again past the checkpoint it resumed from;
- loss deviation: |final loss - single-process reference| / reference, same seed and batches.
A replacement agent is started after each trial, so every trial has a spare. `--shaped`: every agent behind
`devtools.shaper` links of its own (its gRPC port and its peer-stream listener, each advertised as the link), so
the driver's calls, the neighbour streams between stages and the dial-backs all cross a WAN-like link; written as
a section of its own. Prints a table, writes docs/BENCHMARKS.md, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import machine_line, write_section  # noqa: E402
from devtools.cluster import LocalCluster, stage_placement  # noqa: E402
from devtools.launch import free_ports  # noqa: E402
from devtools.reference import reference_run  # noqa: E402
from devtools.shaper import ShaperThread, add_link_arguments, link_shape  # noqa: E402

JOB: dict[str, Any] = {
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 4,
    "learning_rate": 0.05,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 4,
    "seed": 0,
    "stages": 3,
    "checkpoint_interval_steps": 20,
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}
POLL_SECONDS = 0.05


StartAgent = Callable[[str], object]  # starts the named agent (a spare too) and waits until it is ready


def shaped_agent_starter(cluster: LocalCluster, shaper: ShaperThread, shape: dict[str, float]) -> StartAgent:
    """Starts an agent whose gRPC port and peer-stream listener are each reached through a shaped link of its own:
    it advertises the links, so whoever dials it (the driver, its neighbours, the dial-back) crosses one."""
    def start(name: str) -> object:
        grpc_port, stream_port = free_ports(2)
        return cluster.start_agent(
            name, "--listen", f"127.0.0.1:{grpc_port}",
            "--advertise", shaper.address(f"127.0.0.1:{grpc_port}", **shape),
            "--exchange-port", str(stream_port),
            "--advertise-exchange", shaper.address(f"127.0.0.1:{stream_port}", **shape),
        )
    return start


def trial(cluster: LocalCluster, rng: random.Random, index: int, total_steps: int, start_agent: StartAgent
          ) -> dict[str, Any]:
    job = cluster.client.submit_job({**JOB, "name": f"fault-trial-{index}"})
    cluster.client.start_job(job["id"])
    kill_after = rng.randint(JOB["checkpoint_interval_steps"] // 2, total_steps - 30)
    running = cluster.wait_for_job(
        job["id"], lambda d: d["status"] == "running" and d["step"] >= kill_after, 120, poll_seconds=POLL_SECONDS
    )
    stage = rng.randrange(JOB["stages"])
    victim = next(a for a in cluster.agents if a.node_id == stage_placement(running)[stage])
    cluster.crash(victim.child.name)
    killed_at, killed_step = time.monotonic(), running["step"]

    moved = cluster.wait_for_job(
        job["id"], lambda d: stage_placement(d).get(stage) not in (victim.node_id, None), 120,
        poll_seconds=POLL_SECONDS,
    )
    detection = time.monotonic() - killed_at
    resume = moved["resumed_from_step"] or 0
    cluster.wait_for_job(
        job["id"], lambda d: d["status"] == "running" and d["step"] > resume, 120, poll_seconds=POLL_SECONDS
    )
    recovery = time.monotonic() - killed_at
    final = cluster.client.wait(job["id"], timeout=300)
    cluster.agents.remove(victim)
    start_agent(f"spare-{index}")
    return {
        "stage": stage,
        "killed_at_step": killed_step,
        "resumed_from_step": resume,
        "succeeded": final["status"] == "succeeded",
        "detection_seconds": detection,
        "recovery_seconds": recovery,
        "final_loss": final["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seeds the choice of step and stage to kill")
    parser.add_argument("--shaped", action="store_true", help="every agent behind shaped links of its own")
    add_link_arguments(parser)
    args = parser.parse_args()
    if args.trials < 1:
        parser.error("--trials must be at least 1")

    rng = random.Random(args.seed)
    reference = reference_run(JOB)
    results = []
    with tempfile.TemporaryDirectory(prefix="arceus-fault-trials-") as workdir, ShaperThread() as shaper:
        cluster = LocalCluster(workdir=Path(workdir), database_url=os.environ.get("DATABASE_URL"),
                               redis_url=os.environ.get("REDIS_URL"))
        start_agent: StartAgent = (shaped_agent_starter(cluster, shaper, link_shape(args)) if args.shaped
                                   else cluster.start_agent)
        try:
            cluster.start()
            for i in range(JOB["stages"] + 1):
                start_agent(f"agent-{i}")
            for index in range(args.trials):
                result = trial(cluster, rng, index, len(reference.losses), start_agent)
                result["loss_deviation"] = abs(result["final_loss"] - reference.losses[-1]) / reference.losses[-1]
                results.append(result)
                print(f"trial {index}: killed stage {result['stage']} at step {result['killed_at_step']}, "
                      f"resumed from {result['resumed_from_step']}, detected {result['detection_seconds']:.2f}s, "
                      f"recovered {result['recovery_seconds']:.2f}s, loss deviation {result['loss_deviation']:.2e}",
                      file=sys.stderr, flush=True)
        finally:
            cluster.stop()

    detection = [r["detection_seconds"] for r in results]
    recovery = [r["recovery_seconds"] for r in results]
    figures = {
        "trials": len(results),
        "succeeded": sum(r["succeeded"] for r in results),
        "detection_seconds_median": round(statistics.median(detection), 2),
        "recovery_seconds_median": round(statistics.median(recovery), 2),
        "recovery_seconds_max": round(max(recovery), 2),
        "loss_deviation_max": float(f"{max(r['loss_deviation'] for r in results):.3g}"),
    }
    rows = "\n".join(
        f"| {i} | {r['stage']} | {r['killed_at_step']} | {r['resumed_from_step']} | {r['detection_seconds']:.2f} | "
        f"{r['recovery_seconds']:.2f} | {'yes' if r['succeeded'] else 'no'} | {r['loss_deviation']:.1e} |"
        for i, r in enumerate(results)
    )
    table = (
        "| trial | stage killed | at step | resumed from | detection s | recovery s | succeeded | loss deviation |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n" + rows + "\n\n"
        f"{figures['succeeded']}/{figures['trials']} succeeded; detection median "
        f"**{figures['detection_seconds_median']} s**, recovery median **{figures['recovery_seconds_median']} s** "
        f"(max {figures['recovery_seconds_max']} s); largest final-loss deviation from an uninterrupted "
        f"single-process run **{figures['loss_deviation_max']}**.\n"
    )
    backend = "PostgreSQL" if os.environ.get("DATABASE_URL", "").startswith("postgres") else "SQLite"
    shaped = "" if not args.shaped else (
        f" over shaped links (`--shaped --delay-ms {args.delay_ms:g} --rate-mbit {args.rate_mbit:g}`: every agent's "
        "gRPC port and peer-stream listener behind a `devtools.shaper` link of its own, so the neighbour streams "
        "between stages, the driver's calls and the dial-backs cross one)")
    write_section("fault_trials_shaped" if args.shaped else "fault_trials", (
        f"## Killing a stage agent mid-training{shaped} (`bench/fault_trials.py`)\n\n"
        f"{machine_line()}. {args.trials} trials (seed {args.seed}); digits MLP [64, 128, 64, 10] in 3 stages "
        f"plus one spare agent, {JOB['epochs']} epochs ({len(reference.losses)} steps), checkpoint every "
        f"{JOB['checkpoint_interval_steps']} steps; heartbeat 2 s, node grace 6 s, reconcile every 2 s; "
        f"{backend}; a random stage's agent is SIGKILLed after a random step. Detection: kill until the "
        "stage is placed on another node. Recovery: kill until training runs past the checkpoint it "
        "resumed from.\n\n" + table
    ))
    print(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
