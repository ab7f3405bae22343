from __future__ import annotations

from django.contrib import admin

from controlplane.jobs.models import Checkpoint, EpochMetric, Job, LossPoint, Stage, StageCheckpoint, StageContribution

STAGE_FIELDS = [
    "index",
    "rank",
    "layer_start",
    "layer_end",
    "node",
    "generation",
    "active",
    "observed_generation",
    "observed_state",
    "observed_message",
    "samples",
    "micro_batches",
    "compute_seconds",
    "bytes_sent",
    "bytes_received",
]


class StageInline(admin.TabularInline):
    """The placement, as the reconciler and the agents left it: read-only."""

    model = Stage
    fields = STAGE_FIELDS
    readonly_fields = STAGE_FIELDS
    can_delete = False
    extra = 0
    max_num = 0
    show_change_link = True


CONTRIBUTION_FIELDS = [
    "stage_index",
    "generation",
    "node",
    "samples",
    "micro_batches",
    "compute_seconds",
    "bytes_sent",
    "bytes_received",
    "updated_at",
]


class ContributionInline(admin.TabularInline):
    """Each node's work per stage generation: what the contributors did, moves and rewinds included."""

    model = StageContribution
    fields = CONTRIBUTION_FIELDS
    readonly_fields = CONTRIBUTION_FIELDS
    can_delete = False
    extra = 0
    max_num = 0


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "owner",
        "status",
        "progress",
        "generation",
        "restarts",
        "resumed_from",
        "last_loss",
        "val_accuracy",
        "created_at",
    ]
    list_filter = ["status", "owner", "handover_requested"]
    list_select_related = ["owner", "resume_checkpoint"]
    search_fields = ["id", "name", "owner__username"]
    readonly_fields = [
        "id",
        "status",  # changed only by controlplane.controller.transitions
        "generation",
        "conditions",
        "step",
        "total_steps",
        "epoch",
        "last_loss",
        "final_loss",
        "val_loss",
        "val_accuracy",
        "samples_per_second",
        "error",
        "driver_lease_owner",
        "driver_lease_expires_at",
        "restarts",
        "resume_checkpoint",
        "handover_requested",
        "created_at",
        "started_at",
        "finished_at",
    ]
    inlines = [StageInline, ContributionInline]

    @admin.display(description="step")
    def progress(self, job: Job) -> str:
        return f"{job.step}/{job.total_steps if job.total_steps is not None else '?'}"

    @admin.display(description="resumed from step", ordering="resume_checkpoint__step")
    def resumed_from(self, job: Job) -> int | None:
        return job.resume_checkpoint.step if job.resume_checkpoint else None


@admin.register(Stage)
class StageAdmin(admin.ModelAdmin):
    list_display = [
        "__str__",
        "job",
        "index",
        "rank",
        "node",
        "layer_start",
        "layer_end",
        "generation",
        "observed_state",
        "active",
    ]
    list_filter = ["observed_state", "active"]
    list_select_related = ["job", "node"]
    search_fields = ["job__id", "job__name", "node__name"]
    readonly_fields = STAGE_FIELDS + ["job"]


@admin.register(LossPoint)
class LossPointAdmin(admin.ModelAdmin):
    list_display = ["job", "step", "epoch", "loss", "samples_per_second"]
    list_select_related = ["job"]
    search_fields = ["job__id", "job__name"]


@admin.register(EpochMetric)
class EpochMetricAdmin(admin.ModelAdmin):
    list_display = ["job", "epoch", "val_loss", "val_accuracy"]
    list_select_related = ["job"]
    search_fields = ["job__id", "job__name"]


class StageCheckpointInline(admin.TabularInline):
    model = StageCheckpoint
    fields = ["stage_index", "layer_start", "layer_end", "file", "sha256", "size_bytes"]
    readonly_fields = fields
    can_delete = False
    extra = 0
    max_num = 0


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ["job", "step", "epoch", "generation", "created_at"]
    list_select_related = ["job"]
    search_fields = ["job__id", "job__name"]
    readonly_fields = ["job", "step", "epoch", "generation", "created_at"]
    inlines = [StageCheckpointInline]


@admin.register(StageContribution)
class StageContributionAdmin(admin.ModelAdmin):
    list_display = ["job", "stage_index", "generation", "node", "samples", "compute_seconds", "updated_at"]
    list_filter = ["node"]
    list_select_related = ["job", "node"]
    search_fields = ["job__id", "job__name", "node__name"]
    readonly_fields = CONTRIBUTION_FIELDS + ["job"]
