"""Agents that read their job's upload through the control plane, as tests of controlplane/jobs/dataset_reads.py
see them: the node each runs as, the stage it hosts, and the driver's opener counting the bytes the driver reads."""

from __future__ import annotations

import dataclasses
import io
from typing import Any, BinaryIO

from django.utils import timezone

from controlplane.agents.services import node_heartbeat, node_register
from controlplane.datasets.tokens import dataset_samples_open
from controlplane.jobs.models import Job, Stage
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create
from nodeagent.agent import Agent
from nodeagent.control_plane import ControlPlaneClient


@dataclasses.dataclass
class Host:
    node: Node
    token: str
    agent: Agent | None = None
    threads: list[str] = dataclasses.field(default_factory=list)  # the thread of each of its agent's reads


def ready_node(owner, name: str, address: str, certificate: str) -> tuple[Node, str]:  # noqa: ANN001
    node, token = node_create(owner=owner, name=name)
    node_register(node=node, grpc_address=address, tls_certificate=certificate, device_type="cpu",
                  device_name="test cpu", memory_bytes=2**30, flops_fp32=1e9, now=timezone.now())
    node_heartbeat(node=node, observed=[], now=timezone.now())
    return node, token


def reader(live_server, host: Host) -> ControlPlaneClient:  # noqa: ANN001
    return ControlPlaneClient(live_server.url, host.token, timeout=30)


def stage_host(job: Job, hosts: list[Host], index: int) -> Host:
    node_id = Stage.objects.get(job=job, index=index, active=True).node_id
    return next(h for h in hosts if h.node.pk == node_id)


class CountingOpener:
    """The driver's opener of the job's upload (as `train_plan` gives it), counting the bytes the driver reads."""

    def __init__(self, owner_id: Any) -> None:
        self.owner_id, self.bytes_read = owner_id, 0

    def __call__(self, dataset_config: dict[str, Any]) -> BinaryIO:
        return _Counted(dataset_samples_open(owner_id=self.owner_id, dataset_config=dataset_config), self)


class _Counted(io.RawIOBase):
    def __init__(self, handle: BinaryIO, opener: CountingOpener) -> None:
        super().__init__()
        self._handle, self._opener = handle, opener

    def readinto(self, buffer: Any) -> int:
        data = self._handle.read(len(buffer))
        buffer[: len(data)] = data
        self._opener.bytes_read += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self._handle.close()
        super().close()
