"""The scrape config, alert rules and dashboards are checked by the real promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from controlplane.monitoring.collector import scrape_registry
from nodeagent.metrics import AgentMetrics

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMETHEUS = MONITORING / "prometheus"
# Every metric the node agent exports (nodeagent/metrics.py); dashboards and alerts may use no other.
AGENT_METRICS = {
    "arceus_stage_step_seconds",
    "arceus_samples_processed_total",
    "arceus_micro_batches_processed_total",
    "arceus_tensor_bytes_sent_total",
    "arceus_tensor_bytes_received_total",
    "arceus_device_memory_used_bytes",
    "arceus_device_memory_peak_bytes",
    "arceus_stage_assigned",
    "arceus_heartbeat_age_seconds",
    "arceus_compute_seconds_total",
    "arceus_stage_info",
    "arceus_stage_wait_seconds_total",
    "arceus_stage_step_wait_seconds",
    "arceus_replica_micro_batches_total",
    "arceus_replica_samples_total",
    "arceus_replica_compute_seconds_total",
}
# Every metric the control plane exports (controlplane/monitoring/).
CONTROLPLANE_METRICS = {
    "arceus_jobs",
    "arceus_nodes",
    "arceus_nodes_held_back",
    "arceus_ledger_dollars",
    "arceus_reconcile_duration_seconds",
    "arceus_reconcile_last_completed_timestamp_seconds",
    "arceus_reconcile_lag_seconds",
    "arceus_heartbeats_total",
    "arceus_heartbeat_handling_seconds",
    "arceus_node_ready_transitions_total",
    "arceus_drivers_running",
    "arceus_driver_step_seconds",
    "arceus_driver_failures_total",
    "arceus_checkpoint_size_bytes",
    "arceus_checkpoint_save_seconds",
}
DASHBOARDS = {"arceus-nodeagents.json": AGENT_METRICS, "arceus-controlplane.json": CONTROLPLANE_METRICS}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)


def test_scrape_config_and_rules_are_valid(tmp_path: Path) -> None:
    """Checked beside the token file it names (the operator writes it; git ignores it)."""
    config = (PROMETHEUS / "prometheus.yml").read_text()
    assert config.count("/etc/prometheus/metrics-token") == 2  # the scrape of the control plane, the discovery
    (tmp_path / "prometheus.yml").write_text(config.replace("/etc/prometheus/metrics-token", str(tmp_path / "token")))
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "token").write_text("x" * 40)
    result = subprocess.run(["promtool", "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_fire_as_their_unit_tests_expect() -> None:
    result = _promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\barceus_[a-z_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def _dashboard_exprs(name: str) -> list[str]:
    return [t["expr"] for p in json.loads((MONITORING / "grafana" / name).read_text())["panels"] for t in p["targets"]]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_each_dashboard_uses_only_the_metrics_of_what_it_shows(name: str) -> None:
    used = set().union(*(_metric_names(e) for e in _dashboard_exprs(name)))
    assert used, "no arceus_ metric referenced at all"
    assert used <= DASHBOARDS[name], used - DASHBOARDS[name]


def test_alerts_use_only_exported_metrics() -> None:
    used = _metric_names((PROMETHEUS / "alerts.yml").read_text())
    assert used & AGENT_METRICS and used & CONTROLPLANE_METRICS
    assert used <= AGENT_METRICS | CONTROLPLANE_METRICS, used - AGENT_METRICS - CONTROLPLANE_METRICS


def test_the_agent_and_the_control_plane_name_no_metric_alike() -> None:
    assert not AGENT_METRICS & CONTROLPLANE_METRICS


@pytest.mark.django_db
def test_control_plane_exports_every_metric_the_dashboards_rely_on() -> None:
    from controlplane.controller.executor import reconcile_once

    reconcile_once()  # the lag is derived from the newest pass
    exposed = generate_latest(scrape_registry()).decode()
    for name in CONTROLPLANE_METRICS:
        assert re.search(rf"^# HELP {name} ", exposed, re.M), name


def test_agent_exports_every_metric_the_dashboards_rely_on() -> None:
    exposed = generate_latest(AgentMetrics(torch.device("cpu")).registry).decode()
    for name in AGENT_METRICS:
        assert re.search(rf"^# HELP {name} ", exposed, re.M), name
