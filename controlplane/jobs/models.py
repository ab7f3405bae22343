"""Training jobs, their placement (stages) and their recorded progress."""

from __future__ import annotations

from django.conf import settings
from django.core.files.storage import Storage, storages
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.utils import timezone

from arceus.contracts.observed import ObservedState
from arceus.contracts.replica_sync import ReplicaSync, replica_sync_from_json
from arceus.contracts.stage_key import stage_key
from arceus.contracts.status import JobStatus
from controlplane.common.models import BaseModel, enum_choices
from controlplane.nodes.models import Node


def checkpoint_storage() -> Storage:
    """The "checkpoints" storage of settings.STORAGES: the filesystem by default, S3 by setting."""
    return storages["checkpoints"]


DEFAULT_AUDIT_RATE = 0.05


class Optimizer(models.TextChoices):
    SGD = "sgd"
    ADAM = "adam"
    ADAM8BIT = "adam8bit", "Adam with 8-bit moments (bitsandbytes)"


class PipelineSchedule(models.TextChoices):
    """The schedules of arceus.pipeline.schedule.SCHEDULES."""

    GPIPE = "gpipe", "GPipe"
    ONE_F_ONE_B = "1f1b", "1F1B"


class Precision(models.TextChoices):
    """arceus.model.precision.PRECISIONS"""

    FP32 = "fp32", "float32"
    BF16 = "bf16", "bfloat16 autocast"


class Job(BaseModel):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    name = models.CharField(max_length=200)
    status = models.CharField(
        max_length=16, choices=enum_choices(JobStatus), default=JobStatus.CREATED, db_index=True
    )
    # The request, validated and normalised at submit.
    model_config = models.JSONField()
    dataset_config = models.JSONField()
    epochs = models.PositiveIntegerField()
    learning_rate = models.FloatField()
    micro_batches = models.PositiveIntegerField()
    optimizer = models.CharField(max_length=8, choices=Optimizer)
    momentum = models.FloatField()
    weight_decay = models.FloatField()
    seed = models.BigIntegerField()
    stages_requested = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Pipeline stages; empty means all free Ready nodes (up to the layers).",
    )
    requirements = models.JSONField(
        default=dict, blank=True, help_text="What the job asks of its devices (see JobRequirementsInput)."
    )
    checkpoint_interval_steps = models.PositiveIntegerField(
        default=50, help_text="Save a coordinated checkpoint of every stage every N steps (0: only at the end)."
    )
    audit_rate = models.FloatField(
        default=DEFAULT_AUDIT_RATE,
        help_text="Chance that a train step has one micro-batch's forward re-run on another node."
    )
    node_grace_seconds = models.FloatField(
        null=True,
        blank=True,
        help_text="Move a stage once its node has been silent this long (empty: the node's own lease).",
    )
    schedule = models.CharField(
        max_length=8, choices=PipelineSchedule, default=PipelineSchedule.GPIPE, help_text="Pipeline schedule."
    )
    staleness = models.PositiveSmallIntegerField(
        default=0,
        help_text="0: synchronous steps; 1: each step's forwards use the weights before the previous step's update "
        "(PipeDream-2BW, arceus.pipeline.schedule.STALENESS), so a stage overlaps two steps.",
    )
    transfer = models.JSONField(
        default=dict, blank=True, help_text="How activations and gradients travel (arceus.wire.transfer), normalised."
    )
    precision = models.CharField(
        max_length=4, choices=Precision, default=Precision.FP32, help_text="Compute precision of every stage."
    )
    activation_checkpointing = models.BooleanField(
        default=False, help_text="Stages keep only each micro-batch's input and recompute the rest in the backward."
    )
    tensor_parallel = models.JSONField(
        default=dict,
        blank=True,
        help_text='Stages split over groups of nodes, normalised: {} (none), {"size": 2} (every stage), or '
        '{"size": 2, "stages": [1]} (only those).',
    )
    # Replicas per stage (arceus/swarm): placement puts `replicas_min` on distinct nodes, the reconciler adds more
    # up to `replicas_max` while the job runs; 1 and 1: one node (or tensor-parallel group) per stage.
    replicas_min = models.PositiveIntegerField(default=1)
    replicas_max = models.PositiveIntegerField(default=1)
    replica_sync = models.JSONField(
        default=dict,
        blank=True,
        help_text='How often a replicated stage\'s replicas agree (arceus.contracts.replica_sync), normalised: '
        '{"every_steps": 1} (exact) or {"every_steps": H, "outer_lr", "outer_momentum"}; {}: exact.',
    )
    # The next replica id to give out: a replicated stage's ids are never reused within a job (a driver's roster
    # tells a newcomer from a member it lost by its id).
    next_replica = models.PositiveIntegerField(default=0)
    # Rewinds to the last checkpoint that no lost node explains (driver or stage errors); past the
    # setting ARCEUS_JOB_MAX_RESTARTS the job fails instead of retrying forever.
    restarts = models.PositiveIntegerField(default=0)
    # Set while a paused node drains: the driver checkpoints at its next step and lets go of the lease.
    handover_requested = models.BooleanField(default=False)
    # What every stage of the current generation starts from (None: the initial weights).
    resume_checkpoint = models.ForeignKey(
        "Checkpoint", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    # The initial weights the owner uploaded (fine-tuning: the whole model's safetensors under Hugging Face's
    # names, checked when it arrived) and their hash; empty: the weights seeded by `seed`.
    initial_weights = models.FileField(storage=checkpoint_storage, max_length=300, blank=True)
    initial_weights_sha256 = models.CharField(max_length=64, blank=True)
    # Each layer's digest of them (arceus.model.hugging_face), in layer order: what an agent checks the slice
    # of its stage's layers against (the assignment carries its stage's).
    initial_weights_layer_sha256 = models.JSONField(default=list, blank=True)
    # An exported model's program (arceus.model.exported.program: its layers' graphs as JSON, checked against
    # the model config's hashes and the operator allow-list when it arrived) and its hash; empty: none.
    program = models.FileField(storage=checkpoint_storage, max_length=300, blank=True)
    program_sha256 = models.CharField(max_length=64, blank=True)
    # The owner's wish that the finished job be served: its stages placed on agents for inference (weights of its
    # final checkpoint, no optimizer) so that it can be sampled; the reconciler places and releases them.
    serving = models.BooleanField(
        default=False, help_text="Serve the succeeded job for sampling (its stages placed for inference)."
    )
    # The driver's last word on the job (facts the reconciler's rules act on while `driver_outcome_generation` is
    # the job's generation): it trained to the end ("succeeded", with a summary) or cannot train it ("failed": the
    # reason and message). controlplane/driver/progress.py records it under the driver lease.
    driver_outcome = models.CharField(max_length=16, blank=True)
    driver_outcome_reason = models.CharField(max_length=64, blank=True)
    driver_outcome_message = models.TextField(blank=True)
    driver_outcome_generation = models.BigIntegerField(null=True, blank=True)
    # Bumped on every placement change. Agents, stages and the driver carry it; every reconciler
    # write checks it (optimistic concurrency), so a decision made on an old view is never applied.
    generation = models.BigIntegerField(default=0)
    conditions = models.JSONField(default=list, blank=True)
    # Progress, written by the training driver.
    step = models.PositiveIntegerField(default=0)
    total_steps = models.PositiveIntegerField(null=True, blank=True)
    epoch = models.PositiveIntegerField(default=0)
    last_loss = models.FloatField(null=True, blank=True)
    final_loss = models.FloatField(null=True, blank=True)
    val_loss = models.FloatField(null=True, blank=True)
    val_accuracy = models.FloatField(null=True, blank=True)
    samples_per_second = models.FloatField(null=True, blank=True)
    # The last training step its agents may run (controlplane/jobs/step_grant.py): set when it starts running,
    # extended as its progress is recorded, told to the agents in heartbeat replies. None: not started.
    step_grant = models.PositiveIntegerField(
        null=True, blank=True, help_text="The last training step the control plane lets its agents run."
    )
    error = models.TextField(blank=True)
    # The driver's lease: a live driver renews it; the reconciler restarts a driver whose lease expired.
    # An empty owner with an expiry means "a driver task was enqueued and may claim it".
    driver_lease_owner = models.CharField(max_length=200, blank=True)
    driver_lease_expires_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    @property
    def replicated(self) -> bool:
        """Whether its stages are replicated now: it asked for more than one replica of each, and it is not being
        served (a served job's stages are one node each, for inference)."""
        return self.replicas_max > 1 and self.status != JobStatus.SUCCEEDED

    @property
    def replica_sync_config(self) -> ReplicaSync:
        """How its replicas agree (saved normalised by job_submit; rows from before the field hold {}: exact)."""
        return replica_sync_from_json(self.replica_sync)


class Stage(BaseModel):
    """One node's part of a pipeline stage of a job: a layer range on a node (desired) and what its agent
    reports (observed). A tensor-parallel stage has one row per rank (0, 1, ...), each on its own node; a
    replicated stage one row per replica (ids from `Job.next_replica`), each on its own node; any other stage
    is one row, rank 0. Deterministic key `stage_id` so a rerun finds the row instead of
    duplicating it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="stages")
    index = models.PositiveIntegerField()
    rank = models.PositiveIntegerField(default=0, help_text="The node's rank in a tensor-parallel stage.")
    # Which replica of its stage the row is where the job's stages are replicated (`Job.replicas_max` > 1); else 0.
    replica = models.PositiveIntegerField(default=0, help_text="The replica id in a replicated stage.")
    # Placed while the job ran: the agent builds it without the job's checkpoint and the driver copies a live
    # replica's state into it before it takes micro-batches. A rewind clears it (every row rebuilds from the
    # checkpoint).
    joining = models.BooleanField(default=False)
    # Once a joining replica copied its stage's state from a live one (the driver's record): {"from_replica",
    # "size_bytes", "sha256" (of what it copied), "state_sha256" (of the state it then held)}; None before.
    joined = models.JSONField(
        null=True, blank=True,
        help_text="A joining replica's copy of its stage's state from a live replica: from_replica, size_bytes, "
        "sha256, state_sha256.",
    )
    # A live replica the driver fenced after failures between live replicas (the driver's record): the train step
    # from which it may join again, and when it was fenced (its node's time is billed up to then, and from its
    # rejoin on). Both None while it trains; its rejoin (`joined`) and a rewind clear them.
    fenced_until_step = models.PositiveIntegerField(
        null=True, blank=True, help_text="Fenced by the driver: the train step from which it may join again."
    )
    fenced_at = models.DateTimeField(null=True, blank=True)
    # How often the driver fenced it within its window (`fences_counted`): the fences since `fences_since_step`, the
    # train step of the window's first, fewer than ARCEUS_REPLICA_FENCE_WINDOW_STEPS steps ago. The reconciler drops
    # a replica fenced ARCEUS_REPLICA_MAX_FENCES times (controlplane/controller/rules.py). A rewind clears both.
    fences = models.PositiveIntegerField(
        default=0, help_text="Times the driver fenced it within its window of train steps."
    )
    fences_since_step = models.PositiveIntegerField(
        null=True, blank=True, help_text="The train step of the first fence in its window."
    )
    layer_start = models.PositiveIntegerField()
    layer_end = models.PositiveIntegerField()
    node = models.ForeignKey(Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="stages")
    generation = models.BigIntegerField()
    # True while the job is placing or running, i.e. while the stage occupies its node.
    active = models.BooleanField(default=True)
    observed_generation = models.BigIntegerField(null=True, blank=True)
    observed_state = models.CharField(
        max_length=8, choices=enum_choices(ObservedState), default=ObservedState.PENDING
    )
    observed_message = models.TextField(blank=True)
    # The generation at which its node's agent registered again as a fresh process while hosting it (the stage's
    # state was lost): a fact the reconciler's rules act on while it is the stage's generation.
    restarted_generation = models.BigIntegerField(null=True, blank=True)
    # When its node began to hold it (placed, or moved there): the job pays for the device from then, per second
    # held (controlplane/market/services.py, `ledger_record_work`).
    held_since = models.DateTimeField(default=timezone.now)
    samples = models.BigIntegerField(default=0)
    micro_batches = models.BigIntegerField(default=0)
    compute_seconds = models.FloatField(default=0.0)
    bytes_sent = models.BigIntegerField(default=0)
    bytes_received = models.BigIntegerField(default=0)
    # Seconds a recent train step spent computing and waiting (inputs, sends) on this stage, as its agent
    # measured them (averaged over the driver's last write; rank 0, or each replica): the bubble the pipeline
    # drawing shows.
    step_compute_seconds = models.FloatField(null=True, blank=True)
    step_wait_seconds = models.FloatField(null=True, blank=True)
    # A replica's share and speed over the same steps: the micro-batches per step the driver routed to it, and the
    # samples it ran per second of its compute (what the driver's routing weighs it by); null until measured.
    step_micro_batches = models.FloatField(null=True, blank=True)
    step_samples_per_second = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["job", "index", "rank", "replica"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "index", "rank", "replica"], name="stage_unique_job_index_rank_replica"
            ),
            # One stage per node for now: the database refuses a second placement on a busy node even
            # if two reconcilers decided on it at once.
            models.UniqueConstraint(fields=["node"], condition=Q(active=True), name="stage_one_active_per_node"),
        ]

    def __str__(self) -> str:
        return self.stage_id

    @property
    def stage_id(self) -> str:
        return stage_key(self.job_id, self.index, self.rank, self.replica if self.job.replicated else None)


class StageContribution(BaseModel):
    """The work one node did for one stage generation of a job (its agent's counters, which start at
    zero with each generation). Rows outlive moves and rewinds: summed, they are everything each
    contributor did, replayed steps included."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="contributions")
    stage_index = models.PositiveIntegerField()
    generation = models.BigIntegerField()
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="contributions")
    samples = models.BigIntegerField(default=0)
    micro_batches = models.BigIntegerField(default=0)
    compute_seconds = models.FloatField(default=0.0)
    bytes_sent = models.BigIntegerField(default=0)
    bytes_received = models.BigIntegerField(default=0)
    # A replica dropped while its job ran (its Stage row deleted): when its node began to hold it and when the
    # control plane took it off, so work the driver measured before the loss and reports after it is still billed
    # for the time held, and no longer (`controlplane/driver/recording.py`). Null for any other contribution.
    held_since = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    # Dropped for being fenced too often (its link or host kept failing steps): the job places no replica on this node
    # for ARCEUS_REPLICA_FENCED_OUT_SECONDS after `released_at`.
    fenced_out = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["job", "stage_index", "generation"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "stage_index", "generation", "node"], name="contribution_unique_stage_generation_node"
            )
        ]


class LossPoint(BaseModel):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="loss_points")
    step = models.PositiveIntegerField()
    epoch = models.PositiveIntegerField()
    loss = models.FloatField(null=True)
    samples_per_second = models.FloatField(null=True)

    class Meta:
        ordering = ["job", "step"]
        constraints = [models.UniqueConstraint(fields=["job", "step"], name="losspoint_unique_job_step")]


class EpochMetric(BaseModel):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="epoch_metrics")
    epoch = models.PositiveIntegerField()
    val_loss = models.FloatField(null=True)
    val_accuracy = models.FloatField(null=True)

    class Meta:
        ordering = ["job", "epoch"]
        constraints = [models.UniqueConstraint(fields=["job", "epoch"], name="epochmetric_unique_job_epoch")]


class Checkpoint(BaseModel):
    """A coordinated checkpoint: every stage's weights and optimizer state after the same step."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveIntegerField()
    epoch = models.PositiveIntegerField()
    generation = models.BigIntegerField(help_text="The placement generation whose driver saved it.")

    class Meta:
        ordering = ["job", "-step"]
        constraints = [models.UniqueConstraint(fields=["job", "step"], name="checkpoint_unique_job_step")]

    def __str__(self) -> str:
        return f"{self.job_id} step {self.step}"


def stage_checkpoint_path(instance: StageCheckpoint, filename: str) -> str:
    return f"checkpoints/{instance.checkpoint.job_id}/{filename}"


class StageCheckpoint(BaseModel):
    """One stage's part of a checkpoint: a safetensors file in the checkpoint storage, and its hash."""

    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="stages")
    stage_index = models.PositiveIntegerField()
    layer_start = models.PositiveIntegerField()
    layer_end = models.PositiveIntegerField()
    file = models.FileField(upload_to=stage_checkpoint_path, storage=checkpoint_storage, max_length=300)
    sha256 = models.CharField(max_length=64)
    size_bytes = models.BigIntegerField()

    class Meta:
        ordering = ["checkpoint", "stage_index"]
        constraints = [
            models.UniqueConstraint(fields=["checkpoint", "stage_index"], name="stagecheckpoint_unique_index")
        ]


class CheckpointUpload(BaseModel):
    """One stage's state file its agent is asked to upload for a checkpoint: opened by the job's driver,
    filled by the agent's upload (the file, and the hash and size the control plane measured as it arrived),
    then taken over by the checkpoint once every stage's file is in. The state never passes the driver."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoint_uploads")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="+")
    stage_index = models.PositiveIntegerField()
    # The layers the stage holds in the driver's plan: the upload must be exactly their state.
    layer_start = models.PositiveIntegerField()
    layer_end = models.PositiveIntegerField()
    step = models.PositiveIntegerField()
    generation = models.BigIntegerField()
    file = models.FileField(storage=checkpoint_storage, max_length=300, blank=True)
    sha256 = models.CharField(max_length=64, blank=True)
    size_bytes = models.BigIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.job_id} step {self.step} stage {self.stage_index}"


class EstimateStatus(models.TextChoices):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class JobEstimate(BaseModel):
    """A tenant's request for an estimate of a job (its fields as validated), answered by a Celery worker so
    the placement solver never runs in the web process (controlplane/controller/estimate.py)."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="estimates")
    request = models.JSONField(encoder=DjangoJSONEncoder)
    status = models.CharField(max_length=10, choices=EstimateStatus.choices, default=EstimateStatus.PENDING)
    result = models.JSONField(encoder=DjangoJSONEncoder, null=True, blank=True)
    error = models.TextField(blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"estimate {self.id} ({self.status})"
