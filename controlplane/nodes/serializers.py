"""Request and response shapes of the node and agent endpoints."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from arceus.contracts.assignment import OPTIMIZERS
from arceus.contracts.certificates import MAX_CERTIFICATE_CHARS, check_certificate
from arceus.contracts.data_plane import MAX_FEATURES, NEIGHBOUR_STREAM, features_check
from arceus.contracts.possession import MAX_PROOF_CHARS
from arceus.contracts.transfer import ACTIVATION_ENCODINGS, GRADIENT_ENCODINGS
from arceus.errors import SpecError
from arceus.model.precision import PRECISIONS
from arceus.pipeline.schedule import SCHEDULES
from arceus.verify.receipts import ReceiptError, load_public_key
from controlplane.common.fields import StrictFloatField, StrictInputSerializer, StrictIntegerField
from controlplane.nodes.availability import parse_window
from controlplane.nodes.models import DeviceType, Node, Reachability
from controlplane.nodes.selectors import node_liveness, node_unavailable_reason
from controlplane.nodes.validators import validate_grpc_address, validate_lan_address


class NodeCreateInput(serializers.Serializer):
    name = serializers.CharField(max_length=100)


class NodeCreatedOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    token = serializers.CharField(help_text="The agent's token. Shown only in this response.")


class ReadyOutput(serializers.Serializer):
    status = serializers.CharField(source="ready_status")
    reason = serializers.CharField(source="ready_reason")
    message = serializers.CharField(source="ready_message")
    last_transition_time = serializers.DateTimeField(source="ready_transition_at", allow_null=True)


class CurrentStageOutput(serializers.Serializer):
    """The stage a node hosts, as the node selectors read it (`node_list_for_user`)."""

    job_id = serializers.UUIDField(source="current_job_id")
    stage_index = serializers.IntegerField(source="current_stage_index")
    rank = serializers.IntegerField(
        source="current_rank", help_text="rank in the stage's tensor-parallel group (0 for a one-node stage)"
    )


class NodeControlsInput(StrictInputSerializer):
    """The owner's controls; a PUT replaces them all (omitted fields take their defaults)."""

    work_windows = serializers.ListField(
        child=serializers.CharField(), default=list, help_text='UTC, e.g. ["22:00-07:00"]; empty: any time'
    )
    idle_only = serializers.BooleanField(default=False)
    idle_cpu_threshold = StrictFloatField(min_value=0, max_value=1, default=0.5)
    max_memory_bytes = StrictIntegerField(min_value=1, allow_null=True, default=None)
    max_threads = StrictIntegerField(min_value=1, allow_null=True, default=None)

    def validate_work_windows(self, windows: list[str]) -> list[str]:
        for window in windows:
            try:
                parse_window(window)
            except ValueError as exc:
                raise serializers.ValidationError(str(exc)) from None
        return windows


class LinkInput(serializers.Serializer):
    """The agent's link to the control plane, as it measured it."""

    rtt_seconds = StrictFloatField(greater_than=0, max_value=600)
    bandwidth_bytes_per_second = StrictFloatField(greater_than=0)


class LinkOutput(serializers.Serializer):
    rtt_seconds = serializers.FloatField(source="control_plane_rtt_seconds")
    bandwidth_bytes_per_second = serializers.FloatField(source="control_plane_bandwidth_bytes_per_second")
    measured_at = serializers.DateTimeField(source="link_measured_at")


class FlagOutput(serializers.Serializer):
    flagged_at = serializers.DateTimeField()
    reason = serializers.CharField(source="flag_reason")


class NodeOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    owner = serializers.CharField(source="owner.username")
    device_type = serializers.CharField()
    device_name = serializers.CharField()
    memory_bytes = serializers.IntegerField(allow_null=True)
    runtime_memory_bytes = serializers.IntegerField(help_text="what the agent holds before any stage")
    flops_fp32 = serializers.FloatField(allow_null=True)
    flops_fp16 = serializers.FloatField(allow_null=True)
    flops_bf16 = serializers.FloatField(allow_null=True)
    flops_measured = serializers.FloatField(
        allow_null=True, help_text="fp32 FLOP/s the training driver measured; the node is priced and placed by it, "
        "flops_fp32 (the agent's own figure) only bounding it; null: not measured yet (then priced and placed as at "
        "most a laptop)",
    )
    link = serializers.SerializerMethodField(
        help_text="Round trip and bandwidth to the control plane; null: not measured"
    )
    grpc_address = serializers.CharField()
    exchange_address = serializers.CharField(
        help_text="Where other agents dial its replica exchange listener (its relay's instead when relayed); "
        "blank: its agent did not say"
    )
    reachability = serializers.ChoiceField(
        choices=Reachability.choices,
        help_text="direct: the control plane dialled the agent back; relayed: callers reach it through a relay; "
        "unknown: not measured since it registered",
    )
    exchange_reachable = serializers.BooleanField(
        allow_null=True, help_text="Whether the dial-back reached its exchange listener at exchange_address (false: "
        "it hosts no replica of a stage: check the port forward); null: not dialled (relayed: reached through its "
        "relay; no exchange_address; or not measured since it registered)",
    )
    public_key = serializers.CharField(help_text="Hex Ed25519 key of the agent: its receipts verify against it")
    tls_certificate = serializers.CharField(help_text="PEM certificate its gRPC port serves; callers trust no other")
    flag = serializers.SerializerMethodField(
        help_text="Set when a spot check caught the node's work wrong: no new stages, credit withheld."
    )
    ready = ReadyOutput(source="*")
    paused = serializers.BooleanField(help_text="Paused by its owner: takes no stage, hands back what it hosts.")
    controls = serializers.SerializerMethodField()
    unavailable_reason = serializers.SerializerMethodField(
        help_text="Why the node may not work now (paused, outside working hours, owner busy); null: it may."
    )
    last_heartbeat_at = serializers.SerializerMethodField()
    current_stage = serializers.SerializerMethodField()
    registered_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()

    @extend_schema_field(NodeControlsInput)
    def get_controls(self, node: Node) -> dict[str, Any]:
        return NodeControlsInput(node).data

    @extend_schema_field(LinkOutput(allow_null=True))
    def get_link(self, node: Node) -> dict[str, Any] | None:
        return LinkOutput(node).data if node.link_measured_at else None

    @extend_schema_field(FlagOutput(allow_null=True))
    def get_flag(self, node: Node) -> dict[str, Any] | None:
        return FlagOutput(node).data if node.flagged_at else None

    def get_unavailable_reason(self, node: Node) -> str | None:
        liveness = node_liveness(node)
        return node_unavailable_reason(node, timezone.now(), liveness.host_busy_fraction if liveness else None)

    def get_last_heartbeat_at(self, node: Node) -> str | None:
        liveness = node_liveness(node)
        return serializers.DateTimeField().to_representation(liveness.renewed_at) if liveness else None

    def get_current_stage(self, node: Node) -> dict[str, Any] | None:
        return CurrentStageOutput(node).data if node.current_job_id is not None else None


class CapabilitiesInput(serializers.Serializer):
    device_type = serializers.ChoiceField(choices=DeviceType.choices)
    device_name = serializers.CharField(max_length=200, allow_blank=True, default="")
    memory_bytes = StrictIntegerField(min_value=1)
    flops_fp32 = StrictFloatField(greater_than=0)
    flops_fp16 = StrictFloatField(greater_than=0, required=False, allow_null=True, default=None)
    flops_bf16 = StrictFloatField(greater_than=0, required=False, allow_null=True, default=None)
    runtime_bytes = StrictIntegerField(
        min_value=0, default=0, help_text="memory the agent process holds before any stage; placement leaves it room"
    )
    link = LinkInput(required=False, allow_null=True, default=None)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["runtime_bytes"] >= data["memory_bytes"]:
            raise serializers.ValidationError(
                {"runtime_bytes": f"must be below memory_bytes ({data['memory_bytes']}): the agent's own memory"}
            )
        return data


class AgentChallengeOutput(serializers.Serializer):
    challenge = serializers.CharField(help_text="Sign it with the TLS key and register with the signature")
    expires_in_seconds = serializers.IntegerField()


class CheckpointPartsStartInput(StrictInputSerializer):
    size_bytes = StrictIntegerField(min_value=1, help_text="The size of the stage's state file the agent will send")


class CheckpointPartsCompleteInput(StrictInputSerializer):
    multipart_id = serializers.CharField(max_length=1024, help_text="What the upload's start answered")
    sha256 = serializers.RegexField(
        r"^[0-9a-f]{64}$", help_text="The SHA-256 of the file sent: 64 lowercase hex digits")
    size_bytes = StrictIntegerField(min_value=1)


class AgentRegisterInput(serializers.Serializer):
    grpc_address = serializers.CharField(max_length=255, validators=[validate_grpc_address])
    lan_address = serializers.CharField(
        max_length=64, required=False, default="", validators=[validate_lan_address],
        help_text="The agent's private IP:port on its LAN: agents registering from the same public address dial it "
        "there",
    )
    capabilities = CapabilitiesInput()
    public_key = serializers.CharField(
        required=False, default="", help_text="Hex Ed25519 key (64 digits) that signs the agent's receipts"
    )
    exchange_port = serializers.IntegerField(
        min_value=1, max_value=65535, required=False, allow_null=True, default=None,
        help_text="Port of the agent's replica exchange listener on the host of grpc_address, where siblings dial it "
        "unless exchange_address says otherwise",
    )
    exchange_address = serializers.CharField(
        max_length=255, required=False, default="", validators=[validate_grpc_address],
        help_text="Where other agents dial the agent's replica exchange listener, as it advertises it (a router's "
        "port forward to exchange_port); default: the host of grpc_address at exchange_port",
    )
    data_plane = serializers.ListField(
        child=serializers.CharField(), max_length=MAX_FEATURES, required=False, default=list,
        help_text=f"The data-plane features the agent speaks beyond PushStream (arceus/contracts/data_plane.py: "
        f"{NEIGHBOUR_STREAM!r}); a link takes one only where both its agents declared it. Default: none",
    )

    metrics_port = serializers.IntegerField(
        min_value=1, max_value=65535, required=False, allow_null=True, default=None,
        help_text="Port of the agent's Prometheus /metrics on the host of grpc_address (service discovery)",
    )
    tls_certificate = serializers.CharField(
        max_length=MAX_CERTIFICATE_CHARS,
        trim_whitespace=False,
        help_text="PEM certificate the agent's gRPC port serves TLS with; its callers pin it",
    )

    challenge = serializers.CharField(max_length=200, help_text="From POST /api/agent/challenge, at most 5 minutes old")
    tls_proof = serializers.CharField(
        max_length=MAX_PROOF_CHARS,
        help_text="Base64 signature by tls_certificate's key of the challenge (arceus/contracts/possession.py): "
        "proves the agent holds the key",
    )

    def validate_tls_certificate(self, value: str) -> str:
        try:
            return check_certificate(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate_data_plane(self, value: list[str]) -> tuple[str, ...]:
        try:
            return features_check(value, "data_plane")
        except SpecError as exc:
            raise serializers.ValidationError(exc.message) from None

    def validate_public_key(self, value: str) -> str:
        if value:
            try:
                load_public_key(value)
            except ReceiptError as exc:
                raise serializers.ValidationError(str(exc)) from None
        return value.lower()


class AgentRegisteredOutput(serializers.Serializer):
    node_id = serializers.UUIDField()
    heartbeat_interval_seconds = serializers.FloatField()


class AgentLeftOutput(serializers.Serializer):
    node_id = serializers.UUIDField()
    stages = serializers.IntegerField(
        help_text="stages the node still hosts; they move away (the driver checkpoints first), and the agent "
        "may exit once its heartbeat's assignments are empty"
    )


class OptimizerOutput(serializers.Serializer):
    name = serializers.ChoiceField(choices=list(OPTIMIZERS))
    lr = serializers.FloatField()
    momentum = serializers.FloatField()
    weight_decay = serializers.FloatField()


class CheckpointRefOutput(serializers.Serializer):
    step = serializers.IntegerField()
    url = serializers.CharField(help_text="GET it with the node token; safetensors bytes")
    sha256 = serializers.CharField()


class TensorParallelOutput(serializers.Serializer):
    rank = serializers.IntegerField()
    size = serializers.IntegerField()
    peers = serializers.ListField(child=serializers.CharField(), help_text="every rank's address, in rank order")


class TransferOutput(serializers.Serializer):
    activations = serializers.ChoiceField(choices=list(ACTIVATION_ENCODINGS))
    gradients = serializers.ChoiceField(choices=list(GRADIENT_ENCODINGS))
    block_size = serializers.IntegerField(help_text="int8: values per absmax scale")
    topk_ratio = serializers.FloatField(help_text="topk: share of gradient values sent per message")


class CredentialsOutput(serializers.Serializer):
    token = serializers.CharField(help_text="this stage's bearer token (64 hex) for its calls to neighbours and peers")
    accepts = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        help_text="role (driver, prev, next, peer) → SHA-256 digests of the tokens accepted in it, in rank order",
    )


class DataPlaneOutput(serializers.Serializer):
    own = serializers.ListField(child=serializers.CharField(), help_text="The features this agent declared")
    prev = serializers.ListField(
        child=serializers.CharField(), help_text="Those the previous stage's agent declared (none: several agents)"
    )
    next = serializers.ListField(
        child=serializers.CharField(), help_text="Those the next stage's agent declared (none: several agents)"
    )


class AssignmentOutput(serializers.Serializer):
    """Documents the Assignment contract (`arceus.contracts.assignment.Assignment.to_json` builds it)."""

    stage_id = serializers.CharField()
    job_id = serializers.UUIDField()
    stage_index = serializers.IntegerField()
    num_stages = serializers.IntegerField()
    generation = serializers.IntegerField()
    model = serializers.JSONField()
    layer_start = serializers.IntegerField()
    layer_end = serializers.IntegerField()
    seed = serializers.IntegerField()
    optimizer = OptimizerOutput()
    micro_batches = serializers.IntegerField()
    max_micro_batch_size = serializers.IntegerField()
    prev_address = serializers.JSONField(
        allow_null=True, help_text='"host:port"; a tensor-parallel neighbour: the list of its ranks\' addresses'
    )
    next_address = serializers.JSONField(
        allow_null=True, help_text='"host:port"; a tensor-parallel neighbour: the list of its ranks\' addresses'
    )
    credentials = CredentialsOutput(help_text="Who may call the stage's methods (arceus.contracts.credentials)")
    certificates = serializers.DictField(
        child=serializers.CharField(), help_text="address → PEM TLS certificate of every agent the stage calls"
    )
    checkpoint = CheckpointRefOutput(allow_null=True, help_text="The state to resume from; null: the seed's")
    transfer = TransferOutput(help_text="How the stage encodes the activations and gradients it sends")
    precision = serializers.ChoiceField(choices=list(PRECISIONS), help_text="bf16: matmuls under autocast")
    activation_checkpointing = serializers.BooleanField(help_text="recompute activations in the backward")
    schedule = serializers.ChoiceField(
        choices=sorted(SCHEDULES), help_text="The job's pipeline schedule: what the stage's memory is checked for"
    )
    tensor_parallel = TensorParallelOutput(required=False, help_text="Present when the stage is split over nodes")
    data_plane = DataPlaneOutput(
        required=False,
        help_text="The data-plane features of this agent and its neighbours' (arceus/contracts/data_plane.py): a link "
        "takes a neighbour stream where both its agents declared one. Absent for an agent that declared none",
    )


class AgentControlsOutput(serializers.Serializer):
    max_threads = serializers.IntegerField(allow_null=True, help_text="compute threads the owner allows")
    max_memory_bytes = serializers.IntegerField(
        allow_null=True, help_text="memory the owner offers: the agent refuses a stage whose state needs more"
    )


class RelayAssignmentOutput(serializers.Serializer):
    address = serializers.CharField(help_text="HOST:PORT of the relay to stay attached to")
    ticket = serializers.CharField(help_text="presented to the relay: it may attach as this node until it expires")


class AgentHeartbeatOutput(serializers.Serializer):
    node_id = serializers.UUIDField()
    assignments_version = serializers.CharField(help_text="Send it back with the next heartbeat")
    assignments = AssignmentOutput(
        many=True, required=False,
        help_text="The node's whole desired state; left out when the heartbeat's assignments_version is current",
    )
    step_grants = serializers.DictField(
        child=serializers.IntegerField(min_value=0),
        help_text="job id → the last training step the agent may run for that job (it refuses a RunStep beyond it); a "
        "hosted job without one (not running yet) is left out",
    )
    controls = AgentControlsOutput()
    heartbeat_interval_seconds = serializers.FloatField()
    relay = RelayAssignmentOutput(
        allow_null=True, help_text="the relay this node's agent attaches to (the control plane could not dial it)"
    )
    relays = serializers.ListField(
        child=serializers.CharField(), help_text="every relay: where the agent reaches relayed neighbours"
    )
    relay_certificate = serializers.CharField(
        allow_null=True, help_text="the relays' TLS certificate (PEM), which the agent pins; null without relays"
    )
    metrics_token_sha256 = serializers.CharField(
        allow_null=True,
        help_text="SHA-256 (hex) of the token Prometheus presents to this agent's /metrics (from GET /metrics/agents); "
        "the agent refuses any other scrape. Null while the operator has set no ARCEUS_METRICS_TOKEN",
    )
