"""A real Prometheus server (Debian's package) run on the repository's scrape config and alert rules, pointed at a
LocalCluster: the control plane's address in place of compose's "web:8000", and short intervals."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from devtools.cluster import LocalCluster, free_port

PROMETHEUS = Path(__file__).resolve().parents[2] / "monitoring" / "prometheus"


def _config(cluster: LocalCluster, token_file: Path) -> str:
    text = (PROMETHEUS / "prometheus.yml").read_text()
    for old, new, count in (
        ("/etc/prometheus/metrics-token", str(token_file), 2),
        ("web:8000", urlsplit(cluster.api_url).netloc, 2),
        ("scrape_interval: 15s", "scrape_interval: 1s", 1),
        ("evaluation_interval: 15s", "evaluation_interval: 1s", 1),
        ("refresh_interval: 30s", "refresh_interval: 1s", 1),
    ):
        assert text.count(old) == count, f"monitoring/prometheus/prometheus.yml no longer says {old!r}"
        text = text.replace(old, new)
    return text


@contextmanager
def prometheus_for(cluster: LocalCluster, workdir: Path) -> Iterator[str]:
    """The URL of a Prometheus server scraping the cluster (stopped on exit)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "metrics-token").write_text(cluster.metrics_token)
    (workdir / "prometheus.yml").write_text(_config(cluster, workdir / "metrics-token"))
    shutil.copy(PROMETHEUS / "alerts.yml", workdir / "alerts.yml")
    port = free_port()
    with (workdir / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            ["prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def api(url: str, path: str, **params: str) -> Any:
    """GET a Prometheus API path; its `data`, retried while the server is starting."""
    deadline = time.monotonic() + 30
    while True:
        try:
            response = requests.get(f"{url}/api/v1/{path}", params=params, timeout=5)
            response.raise_for_status()
            return response.json()["data"]
        except requests.RequestException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
