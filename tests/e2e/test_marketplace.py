"""The marketplace end to end: heterogeneous agents get proportionate stages, and what the ledger says
each contributor did is what that contributor's own agent counted (its Prometheus metrics); then a real Prometheus
server finds the agents through the control plane's service discovery and scrapes everything."""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import time
from decimal import Decimal
from pathlib import Path

import pytest
import requests

from devtools.cluster import LocalCluster
from tests.e2e.prometheus_server import api, prometheus_for

pytestmark = pytest.mark.slow

JOB = {
    "name": "market-digits",
    # Forward FLOPs per sample (2·in·out): 33k, 131k, 33k, 4k, 0.6k: the heavy layer is where a fast node helps.
    "model_config": {"layer_sizes": [64, 256, 256, 64, 32, 10]},
    "dataset_config": {"name": "digits", "batch_size": 64, "val_batch_size": 360},
    "epochs": 2,
    "learning_rate": 0.05,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 4,
    "stages": 3,
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_faster_agents_get_larger_stages_and_the_ledger_matches_their_counters(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # Declared rates low enough that a stage's compute (tens of ms per micro-batch) outweighs the latency the
    # solver takes from each agent's measured link to the control plane (a few ms on a busy loopback).
    slow = cluster.start_agents(["slow-a", "slow-b"], "--declare-flops", "1e8")
    agents = {agent.name: agent for agent in [*cluster.start_agents(["fast"], "--declare-flops", "4e8"), *slow]}
    # The estimate is computed by the control queue's Celery worker (never the web process) and polled, once
    # every agent's first heartbeat has made its node Ready (an agent says READY when it has registered).
    ids = {agent.node_id for agent in agents.values()}
    deadline = time.monotonic() + 30
    while {n["id"] for n in cluster.client.nodes() if n["ready"]["status"] == "True"} < ids:
        assert time.monotonic() < deadline, cluster.client.nodes()
        time.sleep(0.2)
    estimate = cluster.client.estimate(JOB)
    assert estimate["feasible"] and estimate["candidates"] == 3 and not estimate["cut_short"], estimate
    assert len(estimate["stages"]) == 3
    job = cluster.client.submit_job(JOB)
    cluster.client.start_job(job["id"])
    final = cluster.client.wait(job["id"], timeout=240)
    assert final["status"] == "succeeded", final["error"]

    # The fast node gets the largest stage by compute: here the 131k-FLOP layer alone, which costs it less
    # time than the slow nodes' lighter stages cost them.
    sizes = JOB["model_config"]["layer_sizes"]
    flops = [2 * a * b for a, b in itertools.pairwise(sizes)]
    work = {p["node_id"]: sum(flops[p["layer_start"] : p["layer_end"]]) for p in final["placements"]}
    assert work[agents["fast"].node_id] == max(work.values()) > min(work.values())

    by_node = {p["node_id"]: p for p in final["contributions"]}
    credits = Decimal(0)
    for agent in agents.values():
        # An agent's /metrics is its scrape token's only: without it, nothing, not even which job it hosted.
        refused = requests.get(f"http://{agent.metrics_address}/metrics", timeout=10)
        assert refused.status_code == 401 and job["id"] not in refused.text
        exported = requests.get(f"http://{agent.metrics_address}/metrics", params={"token": agent.metrics_token},
                                timeout=10).text
        earned = cluster.client.session.get(f"{cluster.api_url}/api/nodes/{agent.node_id}/earnings", timeout=30)
        assert earned.status_code == 200, earned.text
        earnings = earned.json()
        # The ledger counts exactly the samples the agent says it ran, and the compute time it measured.
        assert earnings["samples"] == metric(exported, "arceus_samples_processed_total") > 0
        assert math.isclose(earnings["compute_seconds"], metric(exported, "arceus_compute_seconds_total"),
                            rel_tol=1e-6)
        assert earnings["samples"] == by_node[agent.node_id]["samples"]
        credits += Decimal(earnings["credit_usd"])
    # Credits plus the platform's fees are exactly what the developer is charged.
    cost = final["cost"]
    assert credits + Decimal(cost["platform_fee_usd"]) == Decimal(cost["charged_usd"]) > 0

    prometheus_scrapes_the_cluster(cluster, tmp_path / "prometheus", agents.values(), job["id"])


def prometheus_scrapes_the_cluster(cluster: LocalCluster, workdir: Path, agents, job_id: str) -> None:  # noqa: ANN001
    """Prometheus on monitoring/prometheus: the agents found through GET /metrics/agents, every target up, every
    /metrics body clean by `promtool check metrics`, the alert rules loaded, and the control plane's figures
    summed over its processes (the training worker's driver steps come through the web server's /metrics)."""
    with prometheus_for(cluster, workdir) as url:
        expected = {f"{cluster.api_url.removeprefix('http://')}"} | {a.metrics_address for a in agents}
        deadline = time.monotonic() + 30
        while True:
            targets = api(url, "targets")["activeTargets"]
            up = {t["labels"]["instance"] for t in targets if t["health"] == "up"}
            if up == expected == {t["labels"]["instance"] for t in targets}:
                break
            assert time.monotonic() < deadline, targets
            time.sleep(0.5)
        labels = {t["labels"]["node_id"]: t["labels"] for t in targets if t["labels"]["job"] == "arceus-nodeagent"}
        assert {labels[a.node_id]["node"] for a in agents} == {a.name for a in agents}
        assert all(t["device_class"] for t in labels.values())

        for target in targets:  # an agent's scrape URL carries its own token; the control plane wants the operator's
            headers = {} if "token=" in target["scrapeUrl"] else {"Authorization": f"Bearer {cluster.metrics_token}"}
            body = requests.get(target["scrapeUrl"], headers=headers, timeout=10).text
            check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True,
                                   timeout=60)
            assert check.returncode == 0 and not check.stdout + check.stderr, (target["scrapeUrl"], check)

        rules = {r["name"]: r["health"] for g in api(url, "rules")["groups"] for r in g["rules"]}
        assert {"ArceusDriverCrashLoop", "ArceusReconcileLagging", "ArceusSlowHeartbeats", "ArceusNodesFlapping",
                "ArceusAgentDown"} <= rules.keys()
        assert set(rules.values()) <= {"ok", "unknown"}, rules

        def value(query: str) -> float:
            result = api(url, "query", query=query)["result"]
            assert result, query
            return float(result[0]["value"][1])

        assert value('arceus_jobs{status="succeeded"}') == 1
        assert value("arceus_driver_step_seconds_count") > 0  # recorded by the training worker
        assert value("arceus_heartbeats_total") > 0  # by gunicorn's workers
        assert value("arceus_checkpoint_size_bytes_count") > 0
        assert 0 <= value("arceus_reconcile_lag_seconds") < 30
