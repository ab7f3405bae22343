"""Contributor nodes and their leases."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from arceus.relay.address import relayed_address
from controlplane.common.conditions import FALSE, TRUE, UNKNOWN
from controlplane.common.models import BaseModel


class DeviceType(models.TextChoices):
    CPU = "cpu"
    CUDA = "cuda"
    MPS = "mps"


class ReadyStatus(models.TextChoices):
    TRUE = TRUE
    FALSE = FALSE
    UNKNOWN = UNKNOWN


class Reachability(models.TextChoices):
    UNKNOWN = "unknown"  # not measured yet since the agent registered: dialled directly meanwhile
    DIRECT = "direct"  # the control plane dialled the agent back at its address
    RELAYED = "relayed"  # it could not: callers reach the agent through a relay (arceus/relay/)


class Node(BaseModel):
    """A contributor's machine running a node agent. Capabilities are blank until the agent registers."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="nodes")
    name = models.CharField(max_length=100)
    # SHA-256 hex of the agent token; the token itself is shown once and never stored.
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    device_type = models.CharField(max_length=8, choices=DeviceType, blank=True)
    device_name = models.CharField(max_length=200, blank=True)
    memory_bytes = models.BigIntegerField(null=True, blank=True)
    runtime_memory_bytes = models.BigIntegerField(
        default=0, help_text="what the agent process holds before any stage (Python, torch, its servers)"
    )
    flops_fp32 = models.FloatField(null=True, blank=True)
    flops_fp16 = models.FloatField(null=True, blank=True, help_text="measured fp16 matmul FLOP/s; null: unsupported")
    flops_bf16 = models.FloatField(null=True, blank=True, help_text="measured bf16 matmul FLOP/s; null: unsupported")
    # The fp32 FLOP/s the training driver measured (controlplane/driver/progress.py): what the market prices and
    # places the device by, the agent's own figures above only bounding it (controlplane/nodes/device_class.py).
    flops_measured = models.FloatField(null=True, blank=True)
    flops_measured_at = models.DateTimeField(null=True, blank=True)
    # The agent's link to the control plane, measured at registration and every few minutes after.
    control_plane_rtt_seconds = models.FloatField(null=True, blank=True)
    control_plane_bandwidth_bytes_per_second = models.FloatField(null=True, blank=True)
    link_measured_at = models.DateTimeField(null=True, blank=True)
    # Hex Ed25519 key the agent generated at its latest registration; its receipts verify against it.
    public_key = models.CharField(max_length=64, blank=True)
    # PEM certificate the agent's gRPC port serves TLS with, from its latest registration: its callers trust
    # exactly this one (arceus.wire.tls).
    tls_certificate = models.TextField(blank=True)
    # SHA-256 of that certificate's public key (arceus.contracts.possession.key_sha256): a key belongs to one node.
    tls_key_sha256 = models.CharField(max_length=64, blank=True, default="")
    # Set when a spot check caught the node's work wrong (its credit is withheld too), or when its agent restarted
    # while hosting a stage too often (`node_register`): it gets no new stage.
    flagged_at = models.DateTimeField(null=True, blank=True, db_index=True)
    flag_reason = models.TextField(blank=True)
    # When an operator last cleared the flag: restarts before it no longer count towards a new one. Who, and the
    # flag's reason with theirs ("<flag reason> -- cleared: <why>").
    flag_cleared_at = models.DateTimeField(null=True, blank=True)
    flag_cleared_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    flag_clear_reason = models.TextField(blank=True)
    grpc_address = models.CharField(max_length=255, blank=True)
    # The port of the agent's /metrics on the host of `grpc_address`, from its latest registration (Prometheus
    # finds it through GET /metrics/agents); null: the agent did not say.
    metrics_port = models.PositiveIntegerField(null=True, blank=True)
    # Where its replicas' exchange listener is dialled (nodeagent/exchange_stream.py), from its latest registration:
    # the address its agent advertised (a router's port forward), else the host of `grpc_address` at the listener's
    # port; blank: the agent did not say (siblings ask its gRPC port for the listener's).
    exchange_address = models.CharField(max_length=255, blank=True, default="")
    # The data-plane features its agent declared at its latest registration (arceus.contracts.data_plane, sorted):
    # which of its links take a neighbour stream. Empty: an agent of an older version (PushStream links only).
    data_plane = models.JSONField(default=list, blank=True)
    # Measured after each registration by dialling the agent back (controlplane/nodes/reachability.py).
    reachability = models.CharField(max_length=8, choices=Reachability, default=Reachability.UNKNOWN)
    reachability_checked_at = models.DateTimeField(null=True, blank=True)
    # Whether that dial-back also reached its exchange listener at `exchange_address` (only a direct node's is
    # dialled there: a relayed node's siblings reach it through its relay). False: no replica of a stage is placed on
    # it. None: not dialled (no address registered, relayed, or not yet).
    exchange_reachable = models.BooleanField(null=True, blank=True)
    # Where agents on the same LAN dial it (the agent's private address, as it reported it), and its public address
    # as the control plane saw its registration: two nodes behind one public address dial each other at their LAN
    # addresses (`address_for`), not through their router or a relay.
    lan_address = models.CharField(max_length=64, blank=True, default="")
    public_ip = models.GenericIPAddressField(null=True, blank=True)
    # The Ready condition, in columns so the reconciler can filter on it.
    ready_status = models.CharField(max_length=8, choices=ReadyStatus, default=ReadyStatus.UNKNOWN, db_index=True)
    ready_reason = models.CharField(max_length=64, default="NotRegistered")
    ready_message = models.TextField(blank=True, default="waiting for the agent to register")
    ready_transition_at = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(null=True, blank=True)
    # The owner's switch: a paused node takes no new stage and hands back the ones it hosts (drain).
    paused = models.BooleanField(default=False, db_index=True)
    paused_at = models.DateTimeField(null=True, blank=True)
    # Its agent said it is leaving (SIGTERM): it drains like a paused node until the agent registers again.
    leaving_at = models.DateTimeField(null=True, blank=True)
    # The owner's other controls: when and how the device may work (see nodes/availability.py).
    work_windows = models.JSONField(default=list, blank=True, help_text='UTC, e.g. ["22:00-07:00"]; empty: any time')
    idle_only = models.BooleanField(default=False, help_text="work only while the owner's other processes are idle")
    idle_cpu_threshold = models.FloatField(default=0.5, help_text="'idle' means their CPU use is at most this")
    max_memory_bytes = models.BigIntegerField(null=True, blank=True, help_text="offer at most this much memory")
    max_threads = models.PositiveIntegerField(null=True, blank=True, help_text="compute threads the agent may use")

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tls_key_sha256"], condition=~models.Q(tls_key_sha256=""), name="node_tls_key_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    @property
    def is_registered(self) -> bool:
        return self.registered_at is not None

    @property
    def relayed(self) -> bool:
        """Its callers (the driver, neighbouring stages) reach it through a relay: the dial-back found no way in."""
        return self.reachability == Reachability.RELAYED

    @property
    def dial_address(self) -> str:
        """Where its callers (the driver, neighbouring stages) dial the agent."""
        return dial_address(str(self.id), self.grpc_address, self.reachability)

    @property
    def exchange_dial_address(self) -> str:
        """Where its siblings dial its replicas' exchange (stage.proto's ReplicaPeer.exchange_address): blank for a
        relayed node, which is reached through its relay, as its gRPC port is."""
        return "" if self.relayed else self.exchange_address

    def address_for(self, viewer: Node) -> str:
        """Where `viewer`'s agent dials this node's: its LAN address when both registered from one public address
        (one home, one office), else `dial_address`."""
        if self.lan_address and self.public_ip is not None and self.public_ip == viewer.public_ip:
            return self.lan_address
        return self.dial_address


def dial_address(node_id: str, grpc_address: str, reachability: str) -> str:
    """The agent's own address, or the relayed name every relay knows it by (arceus.relay.address)."""
    return relayed_address(node_id) if reachability == Reachability.RELAYED else grpc_address


class NodeLease(BaseModel):
    """The node's lease as its latest registration set it: `renewed_at` is that registration, the floor of its
    liveness. Heartbeats renew the lease in Redis only (`controlplane.nodes.liveness`): no database write."""

    node = models.OneToOneField(Node, on_delete=models.CASCADE, related_name="lease")
    renewed_at = models.DateTimeField()
    duration_seconds = models.FloatField()
    # The CPU share the owner's other processes used, as the agent measured it at this heartbeat.
    host_busy_fraction = models.FloatField(null=True, blank=True)

    def __str__(self) -> str:
        return f"lease of {self.node_id} renewed {self.renewed_at:%H:%M:%S}"


class NodeRestart(BaseModel):
    """Append-only: the node's agent registered again while it hosted a stage (a fresh process, so the stage's
    state since its job's last checkpoint was lost and the job rewound). Too many within
    ARCEUS_NODE_RESTART_WINDOW_SECONDS flag the node (`controlplane.agents.services.node_register`)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="restarts")
    job = models.ForeignKey("jobs.Job", on_delete=models.SET_NULL, null=True, related_name="+")
    stage_index = models.PositiveIntegerField()
    restarted_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-restarted_at"]

    def __str__(self) -> str:
        return f"{self.node_id} restarted {self.restarted_at:%Y-%m-%d %H:%M:%S}"


class NodeLink(BaseModel):
    """The latest figures of a node's link to one of its pipeline neighbours, as the node's agent measured
    them (one row per ordered pair, upserted by heartbeats)."""

    from_node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="links_out")
    to_node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="links_in")
    rtt_seconds = models.FloatField()
    bandwidth_bytes_per_second = models.FloatField()
    measured_at = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["from_node", "to_node"], name="node_link_pair")]

    def __str__(self) -> str:
        return f"link {self.from_node_id} -> {self.to_node_id}"
