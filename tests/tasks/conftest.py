"""Fixtures for the Celery task tests: a user, and real in-process node agents wired to the control
plane through the same services the agent endpoints call."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch
from django.contrib.auth.models import User
from django.utils import timezone

from arceus.checkpoint import decode_checkpoint
from arceus.contracts.assignment import Assignment, CheckpointRef
from arceus.contracts.observed import ObservedStage
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.jobs.checkpoints import checkpoint_upload_receive, stage_checkpoint_for_node
from controlplane.jobs.models import checkpoint_storage
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create
from nodeagent.agent import Agent


@pytest.fixture
def user(db: None) -> User:
    return User.objects.create_user("carol", password="carol-password")


class LiveNode:
    """A real Agent (gRPC server and stage runtime) and its Node row; `sync()` is one heartbeat. `advertise`,
    `exchange_port`, `advertise_exchange`: the agent's (nodeagent.cli's flags), registered as nodeagent.runner does."""

    def __init__(self, user: User, name: str, *, advertise: str | None = None, exchange_port: int = 0,
                 advertise_exchange: str | None = None) -> None:
        self.agent = Agent(
            device=torch.device("cpu"),
            listen="127.0.0.1:0",
            metrics_listen="127.0.0.1:0",
            advertise=advertise,
            exchange_port=exchange_port,
            advertise_exchange=advertise_exchange,
            load_checkpoint=self.load_checkpoint,
            upload_state=self.upload_state,
        )
        self.agent.start()
        self.node, _ = node_create(owner=user, name=name)
        node_register(
            node=self.node,
            grpc_address=self.agent.advertise_address,
            device_type="cpu",
            device_name="cpu",
            memory_bytes=2**30,
            flops_fp32=1e9,
            now=timezone.now(),
            public_key=self.agent.signer.public_key_hex,  # receipts verify, so no node is flagged
            tls_certificate=self.agent.identity.certificate,
            exchange_port=self.agent.exchange_streams.port,  # what nodeagent.runner registers
            exchange_address=advertise_exchange or "",
        )
        self.node.refresh_from_db()

    def load_checkpoint(self, ref: CheckpointRef) -> dict[str, torch.Tensor]:
        """What the agent's fetch over HTTP gets, through the service behind that endpoint: a checkpoint of a
        stage this node hosts, checked against its hash."""
        sc = stage_checkpoint_for_node(node_id=self.node.pk, stage_checkpoint_id=ref.url.rsplit("/", 1)[-1])
        with checkpoint_storage().open(sc.file.name, "rb") as handle:
            return decode_checkpoint(handle.read(), sha256=ref.sha256)

    def upload_state(
        self, path: str, size: int, chunks: Callable[[], Iterable[bytes | memoryview]], seconds: float
    ) -> str:
        """What the agent's PUT of its state does, through the service behind that endpoint (the state of these
        tests' small models held in memory here)."""
        body = io.BytesIO(b"".join(bytes(chunk) for chunk in chunks()))
        upload = checkpoint_upload_receive(
            node_id=self.node.pk, upload_id=path.rstrip("/").rsplit("/", 1)[-1], body=body, length=size
        )
        return upload.sha256

    def sync(self) -> None:
        observed = [ObservedStage(**o) for o in self.agent.observed()]
        assignments = node_heartbeat(node=self.node, observed=observed, now=timezone.now()).assignments
        self.agent.apply_assignments([Assignment.from_json(a) for a in assignments])
        self.node = Node.objects.get(pk=self.node.pk)


@pytest.fixture
def live_nodes(user: User) -> Iterator[list[LiveNode]]:
    nodes = [LiveNode(user, f"live-{i}") for i in range(3)]
    try:
        yield nodes
    finally:
        for live in nodes:
            live.agent.stop(grace=0)
