"""The web server as deployed (gunicorn with controlplane/gunicorn_conf.py, the shared cluster's `web`)."""

from __future__ import annotations

import subprocess
from urllib.parse import urlsplit

import pytest

from controlplane import gunicorn_conf
from devtools.cluster import LocalCluster

pytestmark = pytest.mark.slow


def test_the_web_server_listens_with_the_configured_backlog(cluster: LocalCluster) -> None:
    """gunicorn's asyncio worker listens again with asyncio's default of 100; 10,000 agents connecting then
    overflow the kernel's accept queue (BackloggedASGIWorker says what that cost)."""
    port = urlsplit(cluster.api_url).port
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True)
    [line] = listening.stdout.splitlines()
    state, _, send_queue, *_ = line.split()  # a listening socket's Send-Q is its backlog
    assert state == "LISTEN" and int(send_queue) == gunicorn_conf.backlog == 2048
