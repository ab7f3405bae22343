"""Request and response shapes of the job endpoints."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.reverse import reverse

from arceus.contracts.status import JobStatus
from controlplane.common.fields import (
    StrictBooleanField,
    StrictFloatField,
    StrictInputSerializer,
    StrictIntegerField,
)
from controlplane.jobs.models import DEFAULT_AUDIT_RATE, Job, Optimizer, PipelineSchedule, Precision, Stage
from controlplane.jobs.selectors import job_contributions, job_loss_curve, job_stages, stage_activity, stage_shares
from controlplane.market.selectors import job_cost
from controlplane.market.serializers import JobCostOutput
from controlplane.nodes.labels import OTHERS_NODE, node_label

MAX_EPOCHS = 10_000
MAX_MICRO_BATCHES = 1024
MAX_SEED = 2**63 - 1
MAX_TENSOR_PARALLEL = 64


class JobRequirementsInput(StrictInputSerializer):
    """What the job asks of the devices it runs on; every field is optional."""

    min_memory_bytes = StrictIntegerField(min_value=0, required=False, help_text="per device")
    device_types = serializers.ListField(
        child=serializers.ChoiceField(choices=["cpu", "cuda", "mps"]), min_length=1, required=False
    )
    min_devices = StrictIntegerField(min_value=1, required=False)
    max_devices = StrictIntegerField(min_value=1, required=False)
    max_price_per_hour = StrictFloatField(greater_than=0, required=False, help_text="US dollars, all devices")
    max_total_usd = StrictFloatField(
        greater_than=0, required=False,
        help_text="checked by the estimate; while it trains, the job stops (checkpointed) before its charges pass it",
    )
    deadline = serializers.DateTimeField(
        required=False, help_text="checked by the estimate; while it trains, the job stops (checkpointed) at it"
    )
    owner_diversity = StrictBooleanField(
        required=False,
        help_text="true (the default): no single owner's nodes hold every stage of the job, so no contributor "
        "receives the whole model; false: any placement",
    )

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("min_devices", 1) > data.get("max_devices", data.get("min_devices", 1)):
            raise serializers.ValidationError({"max_devices": ["Must be at least min_devices."]})
        if "device_types" in data:
            data["device_types"] = sorted(set(data["device_types"]))
        if "deadline" in data:
            data["deadline"] = data["deadline"].isoformat()  # stored as JSON
        return data


class JobTensorParallelInput(StrictInputSerializer):
    """Split stages over groups of nodes, Megatron style: each node of a group holds its share of every
    block's attention heads and MLP units (transformers only)."""

    size = StrictIntegerField(
        min_value=2,
        max_value=MAX_TENSOR_PARALLEL,
        required=False,
        help_text="nodes per split stage; must divide a transformer's n_head, or a llama's num_key_value_heads and "
        "intermediate_size (required unless the whole object is {})",
    )
    stages = serializers.ListField(
        child=StrictIntegerField(min_value=0),
        min_length=1,
        required=False,
        help_text="indices of the stages to split (needs `stages`, the stage count); default: every stage",
    )

    def validate_stages(self, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise serializers.ValidationError("Each stage may be listed once.")
        return sorted(value)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data and "size" not in data:  # {} is "no split"; anything else must say how wide
            raise serializers.ValidationError({"size": ["This field is required."]})
        return data


class JobReplicasInput(StrictInputSerializer):
    """Elastic replicas per stage: at least `min` placed, more up to `max` while Ready nodes have room."""

    min = StrictIntegerField(min_value=1, max_value=MAX_MICRO_BATCHES, default=1)
    max = StrictIntegerField(min_value=1, max_value=MAX_MICRO_BATCHES)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["min"] > data["max"]:
            raise serializers.ValidationError({"max": ["Must be at least min."]})
        return data


@extend_schema_field({"oneOf": [{"type": "integer", "minimum": 1}, {"type": "object", "properties": {
    "min": {"type": "integer", "minimum": 1}, "max": {"type": "integer", "minimum": 1}}, "required": ["max"]}]})
class JobReplicasField(serializers.Field):
    """A number of replicas per stage, or {"min": 1, "max": N}; normalised to {"min", "max"}."""

    def to_internal_value(self, data: Any) -> dict[str, int]:
        if isinstance(data, dict):
            replicas = JobReplicasInput(data=data)
            if not replicas.is_valid():
                raise serializers.ValidationError(replicas.errors)
            return dict(replicas.validated_data)
        count = StrictIntegerField(min_value=1, max_value=MAX_MICRO_BATCHES).run_validation(data)
        return {"min": count, "max": count}

    def to_representation(self, value: Any) -> Any:
        return value


class JobSubmitInput(StrictInputSerializer):
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    model_config = serializers.JSONField(help_text='e.g. {"type": "mlp", "layer_sizes": [64, 128, 10]}')
    dataset_config = serializers.JSONField(help_text='e.g. {"name": "digits", "batch_size": 32, "val_batch_size": 360}')
    epochs = StrictIntegerField(min_value=1, max_value=MAX_EPOCHS, default=1)
    learning_rate = StrictFloatField(greater_than=0, default=0.01)
    micro_batches = StrictIntegerField(min_value=1, max_value=MAX_MICRO_BATCHES, default=1)
    optimizer = serializers.ChoiceField(choices=Optimizer.choices, default=Optimizer.SGD)
    momentum = StrictFloatField(min_value=0, less_than=1, default=0.0)
    weight_decay = StrictFloatField(min_value=0, default=0.0)
    seed = StrictIntegerField(min_value=0, max_value=MAX_SEED, default=0)
    stages = StrictIntegerField(
        min_value=1,
        allow_null=True,
        default=None,
        help_text="Pipeline stages (one node each); null: every free Ready node, up to the layer count.",
    )
    requirements = JobRequirementsInput(required=False, default=dict)
    checkpoint_interval_steps = StrictIntegerField(
        min_value=0,
        max_value=1_000_000,
        default=50,
        help_text="Save every stage's state every N steps (0: only at the end); a lost stage resumes from it.",
    )
    audit_rate = StrictFloatField(
        min_value=0,
        max_value=1,
        allow_null=True,
        default=None,
        help_text=f"Chance that a train step is spot-checked: one micro-batch's forward re-run on another node. "
        f"null: {DEFAULT_AUDIT_RATE}, or 0 for a tensor-parallel job, an exported model, or replicas that sync "
        "every few steps (those cannot be spot-checked yet).",
    )
    node_grace_seconds = StrictFloatField(
        greater_than=0,
        allow_null=True,
        default=None,
        help_text="Move a stage once its node has been silent this long; null: the node lease (6 s by default).",
    )
    schedule = serializers.ChoiceField(
        choices=PipelineSchedule.choices,
        default=PipelineSchedule.GPIPE,
        help_text="Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (fewer activations held).",
    )
    staleness = StrictIntegerField(
        default=0,
        help_text="0 (synchronous: equals one process) or 1: a step's forwards use the weights before the previous "
        "step's update (PipeDream-2BW), so each stage runs the next step's forwards while this one's backwards "
        "drain; trains differently from one process. Not with replicas, tensor_parallel, spot checks or an "
        "exported model.",
    )
    transfer = serializers.JSONField(
        default=dict,
        help_text='How activations and gradients travel, e.g. {"activations": "int8", "gradients": "int8"} '
        "(fp32|fp16|bf16|int8; gradients also topk; block_size, topk_ratio). {}: fp32.",
    )
    activation_checkpointing = serializers.BooleanField(
        default=False,
        help_text="Trade compute for memory: each stage keeps only a micro-batch's input between its forward "
        "and backward and recomputes the rest (not with tensor_parallel).",
    )
    precision = serializers.ChoiceField(
        choices=Precision.choices,
        default=Precision.FP32,
        help_text="fp32, or bf16: matmuls under bfloat16 autocast (weights and optimizer state stay float32).",
    )
    tensor_parallel = JobTensorParallelInput(
        required=False,
        default=dict,
        help_text='e.g. {"size": 2}: every stage on 2 nodes; {"size": 2, "stages": [1]}: only stage 1. {}: none.',
    )
    replicas = JobReplicasField(
        required=False,
        default=lambda: {"min": 1, "max": 1},
        help_text='Replicas per stage, each on its own node and taking a share of every step\'s micro-batches: a '
        'number, or {"min": 1, "max": N} to add replicas while Ready nodes have room (at most micro_batches; not '
        "with tensor_parallel or spot checks). 1: one node per stage.",
    )
    replica_sync = serializers.JSONField(
        required=False,
        default=None,
        allow_null=True,
        help_text='How often the replicas of a stage agree (only with replicas > 1): {"every_steps": 1} (the '
        'default: gradients summed every step, equal to one process), or {"every_steps": 16, "outer_lr": 0.7, '
        '"outer_momentum": 0.9}: local steps, weight deltas averaged every 16 (DiLoCo).',
    )


class JobStartInput(StrictInputSerializer):
    epochs = StrictIntegerField(min_value=1, max_value=MAX_EPOCHS, required=False)
    learning_rate = StrictFloatField(greater_than=0, required=False)


class ConditionOutput(serializers.Serializer):
    type = serializers.CharField()
    status = serializers.ChoiceField(choices=["True", "False", "Unknown"])
    reason = serializers.CharField()
    message = serializers.CharField()
    last_transition_time = serializers.DateTimeField()


class JoinedOutput(serializers.Serializer):
    from_replica = serializers.IntegerField(help_text="the live replica whose state it copied, peer to peer")
    size_bytes = serializers.IntegerField(help_text="bytes of state copied (weights, optimizer state and buffers)")
    sha256 = serializers.CharField(help_text="of the state copied")
    state_sha256 = serializers.CharField(help_text="of the state it held once loaded")


class PlacementOutput(serializers.Serializer):
    """One node's part of a stage: the whole stage, one rank of a tensor-parallel stage, or one replica of a
    replicated stage (its counters: the micro-batches the driver saw it process in the current generation)."""

    def get_relayed(self, stage: Stage) -> bool:
        return stage.node is not None and stage.node.relayed

    def get_node_name(self, stage: Stage) -> str | None:
        if stage.node is None:
            return None
        return node_label(node_id=stage.node_id, name=stage.node.name, owner_id=stage.node.owner_id,
                          viewer_id=self.context["viewer_id"])

    stage_index = serializers.IntegerField(source="index")
    rank = serializers.IntegerField(help_text="rank in the stage's tensor-parallel group (0 for a one-node stage)")
    replica = serializers.IntegerField(help_text="replica id in a replicated stage (0 for a one-node stage)")
    joining = serializers.BooleanField(
        help_text="added while the job ran: it copies a live replica's state, then takes micro-batches"
    )
    joined = JoinedOutput(
        allow_null=True,
        help_text="a replica added while the job ran, once it copied its stage's state from a live replica: from "
        "which, how many bytes, their SHA-256 and that of the state it then held (equal); null otherwise",
    )
    layer_start = serializers.IntegerField()
    layer_end = serializers.IntegerField()
    node_id = serializers.UUIDField(allow_null=True)
    node_name = serializers.SerializerMethodField(
        help_text=f"its name when it is one of yours; another contributor's node is {OTHERS_NODE!r} and its id's start"
    )
    relayed = serializers.SerializerMethodField(
        help_text="its callers (the driver, neighbouring stages) reach the node through a relay"
    )
    generation = serializers.IntegerField()
    state = serializers.CharField(source="observed_state")
    message = serializers.CharField(source="observed_message")
    samples = serializers.IntegerField()
    micro_batches = serializers.IntegerField()
    compute_seconds = serializers.FloatField()
    bytes_sent = serializers.IntegerField()
    bytes_received = serializers.IntegerField()
    activity = serializers.SerializerMethodField(
        help_text="joining (copying a live replica's state, no micro-batch taken yet), fenced (taken off the steps "
        "by the driver after failures between live replicas, until fenced_until_step), training, leaving (its node "
        "paused, left or went silent: it is dropped or moved), or its agent's report before it trains (pending, "
        "ready)"
    )
    fenced_until_step = serializers.IntegerField(
        allow_null=True, help_text="a fenced replica: the train step from which it may join again (null: not fenced)"
    )
    fences = serializers.IntegerField(
        help_text="how often the driver fenced it within its window of train steps: at ARCEUS_REPLICA_MAX_FENCES the "
        "control plane drops it (the job's Replicas condition says so) and places a replica on another node"
    )
    step_micro_batches = serializers.FloatField(
        allow_null=True, help_text="micro-batches per step the driver routed to it in recent steps (null: not measured)"
    )
    share = serializers.SerializerMethodField(
        help_text="its part of its stage's micro-batches per step, 0 to 1 (1 for a one-node stage; null: not measured)"
    )
    samples_per_second = serializers.FloatField(
        source="step_samples_per_second", allow_null=True,
        help_text="its measured speed: samples per second of its compute in recent steps (what routing weighs)",
    )

    @extend_schema_field(serializers.CharField())
    def get_activity(self, stage: Stage) -> str:
        return stage_activity(stage, running=self.context["running"])

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_share(self, stage: Stage) -> float | None:
        return self.context["shares"].get(stage.pk)


class ContributionOutput(serializers.Serializer):
    node_id = serializers.UUIDField()
    node_name = serializers.SerializerMethodField(
        help_text=f"its name when it is one of yours; another contributor's node is {OTHERS_NODE!r} and its id's start"
    )
    stage_index = serializers.IntegerField()
    samples = serializers.IntegerField()
    micro_batches = serializers.IntegerField()
    compute_seconds = serializers.FloatField()
    bytes_sent = serializers.IntegerField()
    bytes_received = serializers.IntegerField()

    def get_node_name(self, row: dict[str, Any]) -> str:
        return node_label(node_id=row["node_id"], name=row["node_name"], owner_id=row["node_owner_id"],
                          viewer_id=self.context["viewer_id"])


class StageCheckpointOutput(serializers.Serializer):
    stage_index = serializers.IntegerField()
    layer_start = serializers.IntegerField()
    layer_end = serializers.IntegerField()
    size_bytes = serializers.IntegerField(help_text="the stage's weights and optimizer state (safetensors)")
    sha256 = serializers.CharField()


class CheckpointOutput(serializers.Serializer):
    stages = StageCheckpointOutput(many=True)
    step = serializers.IntegerField()
    epoch = serializers.IntegerField()
    generation = serializers.IntegerField()
    created_at = serializers.DateTimeField()


class LossPointOutput(serializers.Serializer):
    step = serializers.IntegerField()
    epoch = serializers.IntegerField()
    loss = serializers.FloatField(allow_null=True)


class EpochMetricOutput(serializers.Serializer):
    epoch = serializers.IntegerField()
    val_loss = serializers.FloatField(allow_null=True)
    val_accuracy = serializers.FloatField(allow_null=True)


class JobListOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    owner = serializers.CharField(source="owner.username")
    status = serializers.CharField()
    epochs_requested = serializers.IntegerField(source="epochs", help_text="The `epochs` submitted.")
    epoch = serializers.IntegerField(help_text="Current epoch (1-based; 0 before training).")
    step = serializers.IntegerField()
    total_steps = serializers.IntegerField(allow_null=True)
    last_loss = serializers.FloatField(allow_null=True)
    val_accuracy = serializers.FloatField(allow_null=True)
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


class JobDetailOutput(JobListOutput):
    step_grant = serializers.IntegerField(
        allow_null=True,
        help_text="The last training step the control plane lets the job's agents run: set when it starts running, "
        "extended as its steps are recorded while its budget, deadline and checks allow, frozen by a cancel, a budget "
        "stop or a hand-over (its agents stop there). Null before it runs.",
    )
    model_config = serializers.JSONField()
    dataset_config = serializers.JSONField()
    learning_rate = serializers.FloatField()
    micro_batches = serializers.IntegerField()
    optimizer = serializers.CharField()
    momentum = serializers.FloatField()
    weight_decay = serializers.FloatField()
    seed = serializers.IntegerField()
    stages = serializers.IntegerField(source="stages_requested", allow_null=True)
    generation = serializers.IntegerField()
    requirements = serializers.JSONField()
    checkpoint_interval_steps = serializers.IntegerField()
    audit_rate = serializers.FloatField()
    node_grace_seconds = serializers.FloatField(allow_null=True)
    schedule = serializers.CharField()
    staleness = serializers.IntegerField()
    transfer = serializers.JSONField()
    precision = serializers.CharField()
    activation_checkpointing = serializers.BooleanField()
    tensor_parallel = serializers.JSONField()
    replicas = serializers.SerializerMethodField(help_text="Replicas per stage: {min, max}.")
    replica_sync = serializers.SerializerMethodField(
        help_text='How often the replicas of a stage agree: {"every_steps": 1} (exact) or {"every_steps": H, '
        '"outer_lr", "outer_momentum"}.'
    )
    restarts = serializers.IntegerField(help_text="Rewinds not explained by a lost node since the last checkpoint.")
    resumed_from_step = serializers.IntegerField(
        source="resume_checkpoint.step", default=None, allow_null=True, help_text="The checkpoint the stages run from."
    )
    initial_weights_sha256 = serializers.CharField(
        help_text="SHA-256 of the uploaded weights the job starts from (PUT .../initial-weights); empty: seeded."
    )
    program_sha256 = serializers.CharField(
        help_text="SHA-256 of an exported model's uploaded program (PUT .../program); empty: none uploaded."
    )
    checkpoints = serializers.SerializerMethodField()
    cost = serializers.SerializerMethodField(help_text="What the job has been charged so far (US dollars).")
    contributions = serializers.SerializerMethodField(
        help_text="Each node's work per stage over the whole job, including stages it lost or handed over."
    )
    serving = serializers.BooleanField(
        help_text="Its owner asked for the succeeded job to be served for sampling (its Serving condition says "
        "whether its stages are ready)."
    )
    conditions = ConditionOutput(many=True)
    placements = serializers.SerializerMethodField()
    final_loss = serializers.FloatField(allow_null=True)
    val_loss = serializers.FloatField(allow_null=True)
    samples_per_second = serializers.FloatField(allow_null=True)
    loss_curve = serializers.SerializerMethodField()
    epochs = EpochMetricOutput(source="epoch_metrics", many=True, help_text="Validation after each epoch.")
    error = serializers.CharField()

    @extend_schema_field({"type": "object", "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}}})
    def get_replicas(self, job: Job) -> dict[str, int]:
        return {"min": job.replicas_min, "max": job.replicas_max}

    @extend_schema_field({"type": "object", "properties": {
        "every_steps": {"type": "integer"}, "outer_lr": {"type": "number"}, "outer_momentum": {"type": "number"}}})
    def get_replica_sync(self, job: Job) -> dict[str, Any]:
        return job.replica_sync_config.to_json()

    @extend_schema_field(PlacementOutput(many=True))
    def get_placements(self, job: Job) -> list[dict[str, Any]]:
        rows = list(job_stages(job=job))
        context = {"viewer_id": job.owner_id, "running": job.status == JobStatus.RUNNING, "shares": stage_shares(rows)}
        return PlacementOutput(rows, many=True, context=context).data

    @extend_schema_field(JobCostOutput)
    def get_cost(self, job: Job) -> dict[str, Any]:
        return JobCostOutput(job_cost(job=job)).data

    @extend_schema_field(ContributionOutput(many=True))
    def get_contributions(self, job: Job) -> list[dict[str, Any]]:
        return ContributionOutput(job_contributions(job=job), many=True, context={"viewer_id": job.owner_id}).data

    @extend_schema_field(CheckpointOutput(many=True))
    def get_checkpoints(self, job: Job) -> list[dict[str, Any]]:
        return CheckpointOutput(job.checkpoints.order_by("step").prefetch_related("stages"), many=True).data

    @extend_schema_field(LossPointOutput(many=True))
    def get_loss_curve(self, job: Job) -> list[dict[str, Any]]:
        return job_loss_curve(job=job)


class EstimateStageOutput(serializers.Serializer):
    stage_index = serializers.IntegerField()
    rank = serializers.IntegerField(help_text="rank in the stage's tensor-parallel group (0 for a one-node stage)")
    replica = serializers.IntegerField(
        required=False, help_text="replica id in a replicated stage (0 for a one-node stage)"
    )
    node_id = serializers.UUIDField(allow_null=True, help_text="the node, when it is one of yours (else null)")
    node_name = serializers.CharField(help_text=f"its name, when it is one of yours (else {OTHERS_NODE!r})")
    layer_start = serializers.IntegerField()
    layer_end = serializers.IntegerField()
    seconds_per_micro_batch = serializers.FloatField()


class EstimateGrownOutput(serializers.Serializer):
    """What a job with replicas.max above its min is expected to grow to while it runs, on the nodes free now."""

    replicas = serializers.ListField(child=serializers.IntegerField(), help_text="replicas of each stage, in order")
    samples_per_second = serializers.FloatField(help_text="expected, by the swarm model, with every replica")
    price_per_hour = serializers.FloatField(help_text="US dollars, every replica's node, posted prices")
    hours = serializers.FloatField(help_text="the whole run at that speed")
    total_usd = serializers.DecimalField(max_digits=18, decimal_places=6)


class JobEstimateOutput(serializers.Serializer):
    feasible = serializers.BooleanField()
    reason = serializers.CharField(allow_null=True, help_text="why it cannot be placed now")
    candidates = serializers.IntegerField(help_text="free Ready nodes meeting the requirements")
    replicas = serializers.IntegerField(
        required=False, help_text="replicas planned per stage: the job's replicas.min (more are added while it runs: "
        "`grown`)"
    )
    stages = EstimateStageOutput(many=True)
    grown = EstimateGrownOutput(
        required=False, allow_null=True,
        help_text="with replicas.max above replicas.min: the replicas the reconciler would add on the nodes free now "
        "(each where it predicts a gain worth its price, within the cap) and what the job would then get; null when "
        "none would be added",
    )
    samples_per_second = serializers.FloatField(
        required=False, help_text="expected, from measured FLOP/s (replicated: the swarm model's, every replica)"
    )
    hours = serializers.FloatField(required=False)
    price_per_hour = serializers.FloatField(
        required=False, help_text="US dollars, all devices (every replica's node), posted prices"
    )
    total_usd = serializers.DecimalField(max_digits=18, decimal_places=6, required=False)
    within_budget = serializers.BooleanField(required=False, allow_null=True)
    meets_deadline = serializers.BooleanField(required=False, allow_null=True)
    cut_short = serializers.BooleanField(
        help_text="the solver's time ran out: the best placement over the fastest nodes, not over all of them"
    )


class EstimateStatusOutput(serializers.Serializer):
    """An estimate request and, once a worker has computed it, its answer."""

    id = serializers.UUIDField()
    status = serializers.ChoiceField(choices=["pending", "done", "failed"], help_text="poll until not pending")
    url = serializers.SerializerMethodField(help_text="where to poll it")
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    error = serializers.CharField(help_text="why it failed (empty unless failed)")
    result = JobEstimateOutput(allow_null=True, help_text="the estimate, once done")

    def get_url(self, estimate: Any) -> str:
        return reverse("job-estimate-detail", kwargs={"estimate_id": estimate.id}, request=self.context.get("request"))


class JobSampleInput(StrictInputSerializer):
    prompt = serializers.CharField(
        default="\n", max_length=10_000, trim_whitespace=False, help_text="text to continue (default: a newline)"
    )
    length = StrictIntegerField(min_value=1, max_value=5_000, default=300, help_text="tokens to generate")
    temperature = StrictFloatField(min_value=0, max_value=10, default=0.8, help_text="0: always the likeliest")
    seed = StrictIntegerField(min_value=0, max_value=MAX_SEED, default=0)


class JobServeInput(StrictInputSerializer):
    serving = StrictBooleanField(default=True, help_text="true: serve the job; false: stop serving it")


class JobSampleOutput(serializers.Serializer):
    text = serializers.CharField(help_text="the prompt followed by the generated text")
    step = serializers.IntegerField(help_text="training step the agents' weights had reached")
