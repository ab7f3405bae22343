"""`Agent`: the gRPC server hosting this node's stages, its /metrics server, and its desired state."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from arceus.contracts.assignment import Assignment
from arceus.contracts.observed import ObservedStage
from arceus.relay.dialer import use_relays
from arceus.v1 import link_probe_pb2_grpc, relay_pb2, replica_pb2_grpc, stage_pb2, tensor_parallel_pb2_grpc
from arceus.verify.receipts import ReceiptSigner
from arceus.wire.channels import grpc_channel_options
from arceus.wire.tls import TlsIdentity, new_identity
from nodeagent.call_limits import CallLimits
from nodeagent.exchange_stream import exchange_hellos
from nodeagent.hosting import HostedStages
from nodeagent.lan import WILDCARD_HOSTS
from nodeagent.lending import ComputeThreads
from nodeagent.link_probe import LinkProbeServicer
from nodeagent.metrics import AgentMetrics
from nodeagent.neighbour_links import Neighbour, NeighbourLinks
from nodeagent.neighbour_stream import neighbour_hellos
from nodeagent.peer_streams import PeerStreams
from nodeagent.relay_attachment import RelayAttachment
from nodeagent.replica_servicer import ReplicaServicer
from nodeagent.servicer import StageServicer, add_stage_service
from nodeagent.stage import CheckpointLoader, DatasetReader, InitialWeightsLoader, ProgramLoader, StateUploader
from nodeagent.tp_servicer import TensorParallelServicer

log = logging.getLogger(__name__)
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["StageService"].full_name


def split_host_port(address: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" → (host, port); ValueError with the expected form otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:0; port 0 picks a free one)")
    return host, int(port)


class Agent:
    def __init__(
        self,
        *,
        device: torch.device,
        listen: str = "127.0.0.1:0",
        metrics_listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        exchange_port: int = 0,
        advertise_exchange: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_workers: int = 64,
        load_checkpoint: CheckpointLoader | None = None,
        load_program: ProgramLoader | None = None,
        load_initial_weights: InitialWeightsLoader | None = None,
        upload_state: StateUploader | None = None,
        read_dataset: DatasetReader | None = None,
        link_probe_interval: float | None = None,
        solo_threads: int | None = None,
        identity: TlsIdentity | None = None,
    ) -> None:
        """`solo_threads`: torch threads for what a stage computes while every other stage of its pipeline
        waits (its fill and drain), for agents that share one machine and so may borrow each other's
        idle cores; None: the agent's own count. `identity`: the TLS key and certificate it serves with (None:
        a new one, made now; its certificate is registered with the control plane, which tells callers).
        `exchange_port`: where its replicas' exchange listener listens, on the gRPC listen host (0: a free port);
        `advertise_exchange`: the address siblings dial it at (a router's port forward to that port; None: the
        advertised gRPC host at the listener's port)."""
        self._max_threads = torch.get_num_threads()  # what the agent was started with: the most it uses
        if solo_threads is not None and solo_threads < self._max_threads:
            raise ValueError(f"solo_threads ({solo_threads}) is below the agent's {self._max_threads} threads")
        self.device = device
        self._listen = split_host_port(listen)
        self._metrics_listen = split_host_port(metrics_listen)
        self._advertise = advertise
        self._exchange_port = exchange_port
        self._advertise_exchange = advertise_exchange
        for address in (advertise, advertise_exchange):
            if address is not None:
                split_host_port(address)
        self.metrics = AgentMetrics(device)
        # Signs receipts for received activations; its public half is sent when the agent registers.
        self.signer = ReceiptSigner()
        self.identity = identity or new_identity()
        # The replicas' exact exchange runs over peer streams between siblings (listened for with the server).
        self.exchange_streams = PeerStreams(self.identity)
        self.registry = HostedStages(
            device,
            max_message_bytes=max_message_bytes,
            load_checkpoint=load_checkpoint,
            load_program=load_program,
            load_initial_weights=load_initial_weights,
            build_seconds=self.metrics.stage_build_seconds,
            streams=self.exchange_streams,
            read_dataset=read_dataset,
        )
        # RunStep holds a worker for the whole step while the pushes it waits for need others. No caller may
        # hold more than its share of the workers, and none may hold the health check's.
        self._call_limits = CallLimits(self.registry.guards, max_workers=max_workers)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            interceptors=[self._call_limits],
            options=[*grpc_channel_options(max_message_bytes), ("grpc.so_reuseport", 0)],
        )
        add_stage_service(
            StageServicer(
                self.registry,
                self.metrics,
                compute_threads=self.threads,
                signer=self.signer,
                device=device,
                max_message_bytes=max_message_bytes,
                upload_state=upload_state,
                stream_listener=lambda: stage_pb2.NeighbourStreamPortReply(
                    port=self.exchange_streams.port, address=self._advertise_exchange or ""),
            ),
            self._server,
        )
        # The all-reduce partials of the tensor-parallel stages hosted here.
        self.tensor_parallel = self.registry.tensor_parallel
        tensor_parallel_pb2_grpc.add_TensorParallelServiceServicer_to_server(
            TensorParallelServicer(self.tensor_parallel, self.registry.guards), self._server
        )
        # The gradient exchange between the replicas of the replicated stages hosted here.
        replica_pb2_grpc.add_ReplicaServiceServicer_to_server(
            ReplicaServicer(self.registry, self.exchange_streams), self._server
        )
        # Neighbours time their links to this agent with it; `neighbour_links` times this agent's links to
        # them (every `link_probe_interval` seconds and after the stages change; None: never).
        link_probe_pb2_grpc.add_LinkProbeServiceServicer_to_server(
            LinkProbeServicer(self.registry.guards), self._server
        )
        self._link_probe_interval = link_probe_interval
        self.neighbour_links = NeighbourLinks(
            self._neighbour_addresses, self._stepping, interval=link_probe_interval or 0.0
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.grpc_port = 0
        self.metrics_port = 0
        self.compute_threads = self._max_threads  # within the owner's cap; RunStep applies it
        self._solo_threads = self._max_threads if solo_threads is None else solo_threads
        self._owner_cap: int | None = None
        self.relay: RelayAttachment | None = None  # started with the server: it needs the bound port

    def start(self) -> None:
        host, port = self._listen
        credentials = grpc.ssl_server_credentials([(self.identity.key_pem, self.identity.certificate_pem)])
        bound = self._server.add_secure_port(f"{host}:{port}", credentials)
        if bound == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port} (address in use or not local?)")
        self.grpc_port = bound
        try:
            kinds = exchange_hellos(self.registry.adopt_stream) | neighbour_hellos(self.registry.adopt_neighbour_stream)
            self.exchange_streams.listen(host, kinds, self._exchange_port)
        except OSError as exc:
            raise OSError(f"cannot listen for the replicas' exchange on {host}:{self._exchange_port}: {exc}") from None
        self._server.start()
        local_host = "127.0.0.1" if host in WILDCARD_HOSTS else host
        self.relay = RelayAttachment(
            local_host, {relay_pb2.GRPC: bound, relay_pb2.EXCHANGE: self.exchange_streams.port})
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.metrics_port = self.metrics.serve(*self._metrics_listen)
        if self._link_probe_interval is not None:
            self.neighbour_links.start()
        log.info(
            "serving gRPC on %s (advertised as %s), metrics on %s",
            self.grpc_address,
            self.advertise_address,
            self.metrics_address,
        )

    @property
    def grpc_address(self) -> str:
        return f"{self._listen[0]}:{self.grpc_port}"

    @property
    def exchange_address(self) -> str:
        """Where its replicas' exchange listener is reached: `advertise_exchange`, else the advertised host at the
        listener's port (what it registers, and the control plane names to siblings: ReplicaPeer.exchange_address)."""
        if self._advertise_exchange is not None:
            return self._advertise_exchange
        return f"{self.advertise_address.rsplit(':', 1)[0]}:{self.exchange_streams.port}"

    @property
    def advertise_address(self) -> str:
        """What other agents and drivers dial: --advertise, else the listen address (a wildcard host is
        replaced by this machine's name)."""
        if self._advertise is not None:
            return self._advertise
        host = self._listen[0]
        return f"{socket.getfqdn() if host in WILDCARD_HOSTS else host}:{self.grpc_port}"

    @property
    def metrics_address(self) -> str:
        return f"{self._metrics_listen[0]}:{self.metrics_port}"

    def apply_assignments(
        self, assignments: list[Assignment], rejected: Sequence[ObservedStage] = ()
    ) -> bool:
        """Sync the hosted stages to `assignments` (the whole desired state); True if anything changed."""
        changed = self.registry.apply(assignments, rejected)
        if changed:
            self.neighbour_links.wake()
        self.metrics.set_stages(
            (s.assignment.job_id, s.assignment.stage_index, s.assignment.replica) for s in self.registry.stages()
        )
        return changed

    def take_caps(self, *, max_threads: int | None, max_memory_bytes: int | None) -> None:
        """The owner's caps from a heartbeat answer: compute threads, and the memory the stages may hold (a stage
        that would not fit is refused when it is assigned; one already hosted stays)."""
        self.limit_threads(max_threads)
        self.registry.memory_budget = max_memory_bytes

    def take_step_grants(self, grants: dict[str, int]) -> None:
        self.registry.grants.update(grants)

    def ask_heartbeats_with(self, beat: Callable[[], None]) -> None:
        self.registry.grants.ask_heartbeats_with(beat)

    def heartbeat_answered(self, *, metrics_token_sha256: str | None) -> None:
        self.metrics.heartbeat_succeeded()
        self.metrics.accept_scrapes(metrics_token_sha256)

    def take_neighbour_links(self) -> list[dict[str, Any]]:
        return self.neighbour_links.take()

    def relay_report(self) -> dict[str, Any] | None:
        return self.relay.report() if self.relay is not None else None

    def limit_threads(self, max_threads: int | None) -> None:
        """Take the owner's cap on compute threads (None: what the agent was started with). Thread counts
        are per OS thread in OpenMP, so each step sets it on the thread that computes."""
        wanted = self._max_threads if max_threads is None else min(max_threads, self._max_threads)
        self._owner_cap = max_threads
        if wanted != self.compute_threads:
            log.info("compute threads now %d (owner's cap: %s)", wanted, max_threads)
            self.compute_threads = wanted

    def threads(self) -> ComputeThreads:
        """What the next step computes with: the owner's cap bounds the borrowed threads too."""
        solo = self._solo_threads if self._owner_cap is None else min(self._solo_threads, self._owner_cap)
        return ComputeThreads(own=self.compute_threads, solo=max(solo, self.compute_threads))

    def _neighbour_addresses(self) -> dict[str, Neighbour]:
        """Each neighbour's address, the token its stage accepts from ours, and its agent's certificate."""
        hosted = [s.assignment for s in self.registry.stages()]
        own = self.advertise_address
        return {
            address: Neighbour(s.credentials.token, s.certificates[address])
            for s in hosted
            for address in (s.prev_address, s.next_address)
            if address is not None and address != own
        }

    def _stepping(self) -> bool:
        return any(s.step_lock.locked() for s in self.registry.stages())

    def follow_relay(self, relay: dict[str, str] | None, relays: Sequence[str], certificate: str) -> None:
        """Attach to the relay the control plane assigned (None: the agent is dialled directly), and reach relayed
        neighbours through `relays`; every relay is pinned to `certificate`."""
        use_relays(relays, certificate)
        if self.relay is not None:
            self.relay.assign(relay["address"] if relay else None, relay["ticket"] if relay else "", certificate)

    def observed(self) -> list[dict[str, Any]]:
        return [o.to_json() for o in self.registry.observed()]

    def stop(self, grace: float = 5.0) -> None:
        """Let a step in flight finish (at most `grace` seconds), then stop serving. Push streams stay open
        as long as their senders live, so a graceful server stop would always wait them out."""
        self.neighbour_links.stop()
        if self.relay is not None:
            self.relay.stop()
        self._health.enter_graceful_shutdown()
        self._wait_for_steps_in_flight(grace)
        self._server.stop(None).wait()
        self.exchange_streams.close()
        self._call_limits.stop()
        self.registry.close()
        self.tensor_parallel.close()
        self.metrics.stop()

    def _wait_for_steps_in_flight(self, grace: float) -> None:
        """(A method of its own: a loop variable left in `stop` would keep a stage alive through its drop.)"""
        deadline = time.monotonic() + grace
        for stage in self.registry.stages():
            if stage.step_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                stage.step_lock.release()
