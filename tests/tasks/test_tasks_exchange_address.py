"""A replicated stage whose agents sit behind home routers: each router has a public address of its own and forwards
two ports to its agent, one to the gRPC port (the advertised address, `--advertise`) and one to the replicas' exchange
listener (`--exchange-port`, advertised as `--advertise-exchange`). Nothing listens at the public address's other
ports, so a sibling that dialled the public host at the listener's own port (what it did before agents registered
an exchange address) reaches nothing: the job trains only because each sibling dials the exchange address its agent
registered, and the router's forward carries the stream.

Real in-process agents, the control plane's services and the training-driver task (as in test_tasks_training.py).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.services import job_start, job_submit
from devtools.launch import free_ports
from tasks.control import reconcile
from tasks.training import run_job
from tests.tasks.conftest import LiveNode

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = [64, 32, 16, 10]
JOB = {
    "model_config": {"layer_sizes": MODEL},
    "dataset_config": {"name": "digits", "batch_size": 128, "val_batch_size": 360},
    "epochs": 1,
    "learning_rate": 0.1,
    "optimizer": "sgd",
    "micro_batches": 2,
    "seed": 1,
    "stages": 1,
    "replicas": {"min": 2, "max": 2},
    "requirements": {"owner_diversity": False},  # the live nodes are all the user's
}
ROUTERS = ("127.0.0.3", "127.0.0.4")  # each home's public address (the loopback network is 127/8)


class PortForward:
    """A router's port forward: connections to `address` (on the router's public host) are spliced onto 127.0.0.1 at
    `target` (settable until the first connection); counts the connections and the bytes sent through it."""

    def __init__(self, host: str, target: int = 0) -> None:
        self.target = target
        self.connections = 0
        self.bytes_in = 0
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, name=f"forward-{self.address}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self._server.accept()
            except OSError:  # closed
                return
            self.connections += 1
            try:
                outside = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                inside.close()
                continue
            self._open += [inside, outside]
            threading.Thread(target=self._pump, args=(inside, outside, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(outside, inside, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, inbound: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if inbound:
                    self.bytes_in += len(data)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._server.close()
        for sock in self._open:
            sock.close()


@pytest.fixture
def homes(user) -> Iterator[list[tuple[LiveNode, PortForward]]]:  # noqa: ANN001
    """Two live nodes, each behind its router: [(node, its exchange forward)]."""
    started: list[tuple[LiveNode, PortForward, PortForward]] = []
    try:
        for i, (router, exchange_port) in enumerate(zip(ROUTERS, free_ports(len(ROUTERS)), strict=True)):
            grpc_forward, exchange_forward = PortForward(router), PortForward(router, exchange_port)
            live = LiveNode(user, f"home-{i}", advertise=grpc_forward.address, exchange_port=exchange_port,
                            advertise_exchange=exchange_forward.address)
            grpc_forward.target = live.agent.grpc_port
            started.append((live, grpc_forward, exchange_forward))
        yield [(live, exchange) for live, _, exchange in started]
    finally:
        for live, *forwards in started:
            live.agent.stop(grace=0)
            for forward in forwards:
                forward.close()


def test_replicas_behind_routers_exchange_at_the_addresses_their_agents_registered(user, homes) -> None:  # noqa: ANN001
    for live, exchange in homes:
        # Registered as advertised; the listener's own port at the public host leads nowhere.
        assert live.node.exchange_address == exchange.address != f"{live.node.grpc_address.rpartition(':')[0]}:" \
            f"{live.agent.exchange_streams.port}"
        live.sync()
    job = job_start(job=job_submit(owner=user, **JOB))
    reconcile()  # place
    for live, _ in homes:
        live.sync()  # build the stage
        live.sync()  # report it ready
    reconcile_once()
    job.refresh_from_db()
    assert job.status == "running", job.conditions
    assert sorted(Stage.objects.filter(job=job).values_list("replica", flat=True)) == [0, 1]
    assert run_job(str(job.id)) == "succeeded"
    job = Job.objects.get(pk=job.pk)
    assert job.step == job.total_steps > 1
    # The lower replica dials the higher: one stream, through the higher's router, carrying at least the gradient
    # half the dialler owns (fp32) every step.
    carried = [exchange for _, exchange in homes if exchange.connections]
    parameters = sum(a * b + b for a, b in zip(MODEL, MODEL[1:], strict=False))
    assert len(carried) == 1 and carried[0].bytes_in > job.step * parameters * 4 / 2
