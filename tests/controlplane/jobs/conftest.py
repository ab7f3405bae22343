"""Fixtures of the jobs' tests that read uploads: the datasets' storage on a filesystem or an S3 bucket, and two
agents reading through the control plane."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from django.utils import timezone

from arceus.wire.tls import new_identity
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.datasets.models import Dataset, dataset_storage
from controlplane.nodes.services import node_create
from controlplane.settings import checkpoint_storage_settings
from devtools.pipeline import remember_identity
from nodeagent.agent import Agent
from nodeagent.control_plane import ControlPlaneClient
from tests.controlplane.conftest import S3Server
from tests.controlplane.jobs.upload_readers import Host


@pytest.fixture
def dataset_dir(settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:  # noqa: ANN001
    settings.STORAGES = {
        **settings.STORAGES,
        "datasets": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}},
    }
    monkeypatch.setattr(Dataset._meta.get_field("file"), "storage", dataset_storage())
    return tmp_path


@pytest.fixture
def s3_datasets(s3_server: S3Server, settings, monkeypatch: pytest.MonkeyPatch) -> Any:  # noqa: ANN001
    settings.STORAGES = {**settings.STORAGES, "datasets": checkpoint_storage_settings(s3_server.env)}
    monkeypatch.setattr(Dataset._meta.get_field("file"), "storage", dataset_storage())
    return s3_server.client


@pytest.fixture
def hosts(live_server, user) -> Iterator[list[Host]]:  # noqa: ANN001
    """Two agents in this process, each a Ready node of the user's, reading datasets through the control plane as
    that node (as nodeagent/runner.py gives an agent its client)."""
    made: list[Host] = []
    try:
        for i in range(2):
            identity = new_identity()
            node, token = node_create(owner=user, name=f"reader-{i}")
            client, threads = ControlPlaneClient(live_server.url, token, timeout=30), []

            def read(job_id: str, ranges: list[tuple[int, int]], client=client, threads=threads) -> list[bytes]:  # noqa: ANN001
                threads.append(threading.current_thread().name)
                return client.read_dataset_ranges(job_id, ranges)

            agent = Agent(device=torch.device("cpu"), identity=identity, read_dataset=read)
            agent.start()
            made.append(Host(node, token, agent, threads))
            remember_identity(agent.grpc_address, identity)
            node_register(node=node, grpc_address=agent.grpc_address, tls_certificate=identity.certificate,
                          device_type="cpu", device_name="test cpu", memory_bytes=2**30, flops_fp32=1e9,
                          now=timezone.now())
            node_heartbeat(node=node, observed=[], now=timezone.now())
        yield made
    finally:
        for host in made:
            host.agent.stop(grace=1)
