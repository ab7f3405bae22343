"""GET /metrics and GET /metrics/agents: the operator's bearer token only; what a scrape and the agents'
service discovery answer, read from the real services."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from arceus.contracts.counters import StageCounters
from arceus.contracts.credentials import token_digest
from arceus.contracts.scrape import agent_scrape_token
from controlplane.agents.heartbeat import heartbeat_body
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.controller.executor import reconcile_once
from controlplane.market.services import ledger_record_work
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create, node_set_paused
from devtools.pipeline import identity_for

TOKEN = "t" * 40


@pytest.fixture
def metrics_token(settings) -> str:  # noqa: ANN001
    settings.ARCEUS_METRICS_TOKEN = TOKEN
    return TOKEN


def scrape(client: Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> (sorted labels -> value) of every sample of GET /metrics."""
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


@pytest.mark.parametrize("path", ["/metrics", "/metrics/agents"])
@pytest.mark.parametrize(
    "header", [None, "Bearer wrong", f"Token {TOKEN}", f"Bearer {TOKEN}x", "Bearer", f"Basic {TOKEN}"]
)
def test_the_endpoints_refuse_callers_without_the_token(
    client: Client, metrics_token: str, path: str, header: str | None
) -> None:
    response = client.get(path, **({"HTTP_AUTHORIZATION": header} if header else {}))
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="arceus-metrics"'
    assert response.json() == {"detail": "send the metrics token: Authorization: Bearer <ARCEUS_METRICS_TOKEN>"}


@pytest.mark.parametrize("path", ["/metrics", "/metrics/agents"])
def test_without_a_configured_token_the_endpoints_are_off(client: Client, settings, path: str) -> None:  # noqa: ANN001
    settings.ARCEUS_METRICS_TOKEN = ""
    response = client.get(path, HTTP_AUTHORIZATION="Bearer ")
    assert response.status_code == 403
    assert "ARCEUS_METRICS_TOKEN" in response.json()["detail"]


def test_only_get(client: Client, metrics_token: str) -> None:
    assert client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405


def test_a_short_token_stops_the_settings_with_how_to_fix_it() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import controlplane.settings"], capture_output=True, text=True, timeout=60,
        env={"ARCEUS_METRICS_TOKEN": "short", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert "ARCEUS_METRICS_TOKEN has 5 characters; use at least 32" in result.stderr


@pytest.mark.django_db
def test_a_scrape_counts_jobs_nodes_and_the_ledger_without_naming_anyone(
    client: Client, metrics_token: str, user, ready_node, queued_job  # noqa: ANN001
) -> None:
    a, b = ready_node("secret-node-a", port=5001), ready_node("secret-node-b", port=5002)
    node_create(owner=user, name="never-registered")
    node_set_paused(node=b, user=user, paused=True, now=timezone.now())
    job = queued_job(name="secret-job-name")
    ledger_record_work(
        job_id=job.id, generation=job.generation, node=a, step=1, flops_per_sample=1e12,
        held_since=timezone.now() - timedelta(hours=1), now=timezone.now(),
        counters=StageCounters(index=0, samples=10_000, micro_batches=4, compute_seconds=360.0, bytes_sent=0,
                               bytes_received=0),
    )
    body = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode()
    for secret in ("secret-node-a", "secret-job-name", str(a.id), str(job.id), user.username, "127.0.0.1"):
        assert secret not in body
    samples = scrape(client)
    assert samples["arceus_jobs"][(("status", "queued"),)] == 1
    assert samples["arceus_jobs"][(("status", "running"),)] == 0
    assert samples["arceus_nodes"] == {
        (("ready", "True"),): 2, (("ready", "Unknown"),): 0, (("ready", "False"),): 0, (("ready", "NotRegistered"),): 1
    }
    assert samples["arceus_nodes_held_back"] == {
        (("reason", "paused"),): 1, (("reason", "leaving"),): 0, (("reason", "flagged"),): 0
    }
    ledger = samples["arceus_ledger_dollars"]
    assert ledger[(("kind", "charged"),)] > 0
    assert ledger[(("kind", "charged"),)] == pytest.approx(
        ledger[(("kind", "fees"),)] + ledger[(("kind", "credited"),)] + ledger[(("kind", "withheld"),)]
    )


@pytest.mark.django_db
def test_heartbeats_reconcile_passes_and_lost_nodes_are_recorded(
    client: Client, metrics_token: str, ready_node  # noqa: ANN001
) -> None:
    node = ready_node("n", now=timezone.now() - timedelta(minutes=1))  # its lease has expired by now
    before = scrape(client)
    reconcile_once()  # marks it Unknown
    node_heartbeat(node=Node.objects.get(pk=node.pk), observed=[], now=timezone.now())  # and back to True
    after = scrape(client)

    def grew(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[name][labels] - before.get(name, {}).get(labels, 0.0)

    assert grew("arceus_heartbeats_total") == 1
    assert grew("arceus_heartbeat_handling_seconds_count") == 1
    assert grew("arceus_reconcile_duration_seconds_count") == 1
    assert grew("arceus_node_ready_transitions_total", (("ready", "Unknown"),)) == 1
    assert grew("arceus_node_ready_transitions_total", (("ready", "True"),)) == 1
    assert 0 <= after["arceus_reconcile_lag_seconds"][()] < 5


@pytest.mark.django_db
def test_agent_targets_are_registered_nodes_that_are_not_gone(client: Client, metrics_token: str, user) -> None:  # noqa: ANN001
    now = timezone.now()

    def node(name: str, address: str, metrics_port: int | None, heartbeat_at=None) -> Node:  # noqa: ANN001
        made, _ = node_create(owner=user, name=name)
        node_register(
            node=made, grpc_address=address, tls_certificate=identity_for(address).certificate, device_type="cpu",
            device_name="cpu", memory_bytes=16 * 2**30, flops_fp32=5e11, now=heartbeat_at or now,
            metrics_port=metrics_port,
        )
        node_heartbeat(node=made, observed=[], now=heartbeat_at or now)
        return made

    v4 = node("laptop", "10.0.0.1:50051", 9400)
    v6 = node("desk", "[2001:db8::1]:50051", 9401)
    node("old-agent", "10.0.0.2:50051", None)  # did not say where its metrics are
    node("gone", "10.0.0.3:50051", 9400, heartbeat_at=now - timedelta(minutes=11))
    node_create(owner=user, name="never-registered")
    response = client.get("/metrics/agents", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    # Each target carries what opens its agent's /metrics, as a URL parameter of its scrape.
    assert response.json() == [
        {"targets": ["10.0.0.1:9400"], "labels": {"node": "laptop", "node_id": str(v4.id),
                                                 "device_class": "standard-medium",
                                                 "__param_token": agent_scrape_token(TOKEN, str(v4.id))}},
        {"targets": ["[2001:db8::1]:9401"], "labels": {"node": "desk", "node_id": str(v6.id),
                                                      "device_class": "standard-medium",
                                                      "__param_token": agent_scrape_token(TOKEN, str(v6.id))}},
    ]
    # A heartbeat answer tells each agent the digest of its own token, and no other.
    answer = heartbeat_body(node_id=str(v4.id), version="", max_threads=None, max_memory_bytes=None,
                            reachability=v4.reachability, relay=None, step_grants={})
    assert answer["metrics_token_sha256"] == token_digest(agent_scrape_token(TOKEN, str(v4.id)))
    assert agent_scrape_token(TOKEN, str(v4.id)) != agent_scrape_token(TOKEN, str(v6.id))


def test_a_dead_processs_live_gauges_leave_and_its_counters_stay(tmp_path) -> None:  # noqa: ANN001
    """Multiprocess mode: what gunicorn's child_exit and Celery's worker_process_shutdown do."""
    script = """
import multiprocessing, os
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from controlplane.common import metrics

def work():
    metrics.HEARTBEATS.inc()
    metrics.DRIVERS_RUNNING.inc()

def read(name):
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return sum(s.value for f in registry.collect() for s in f.samples if s.name == name)

child = multiprocessing.get_context("fork").Process(target=work)
child.start(); child.join()
print(read("arceus_heartbeats_total"), read("arceus_drivers_running"))
metrics.process_exited(child.pid)
print(read("arceus_heartbeats_total"), read("arceus_drivers_running"))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["1.0 1.0", "1.0 0.0"]
    assert any(f.name.startswith("counter_") and f.name.count("_") >= 2 for f in tmp_path.iterdir())
