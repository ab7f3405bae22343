"""Jobs in the admin: read-only pages; cancel and start (retry) call the jobs services."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet, Sum
from django.http import HttpRequest

from controlplane.common.admin import ReadOnlyAdminMixin, ReadOnlyInline, act_on_each
from controlplane.jobs.models import Checkpoint, EpochMetric, Job, LossPoint, Stage, StageCheckpoint, StageContribution
from controlplane.jobs.services import job_cancel, job_start

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


class StageInline(ReadOnlyInline):
    """The placement, as the reconciler and the agents left it."""

    model = Stage
    fields = STAGE_FIELDS
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


class ContributionInline(ReadOnlyInline):
    """Each node's work per stage generation: what the contributors did, moves and rewinds included."""

    model = StageContribution
    fields = CONTRIBUTION_FIELDS


@admin.register(Job)
class JobAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = [
        "name",
        "id",
        "owner",
        "status",
        "progress",
        "cost",
        "generation",
        "restarts",
        "resumed_from",
        "last_loss",
        "val_accuracy",
        "created_at",
    ]
    list_filter = ["status", "owner", "created_at", "handover_requested"]
    list_select_related = ["owner", "resume_checkpoint"]
    search_fields = ["id", "name", "owner__username"]
    date_hierarchy = "created_at"
    inlines = [StageInline, ContributionInline]
    actions = ["cancel", "start"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        return super().get_queryset(request).annotate(charged_micros=Sum("ledger_entries__charge_micros"))

    @admin.display(description="step")
    def progress(self, job: Job) -> str:
        return f"{job.step}/{job.total_steps if job.total_steps is not None else '?'}"

    @admin.display(description="cost ($)", ordering="charged_micros")
    def cost(self, job: Job) -> str:
        """What its owner has been charged so far (refunds of rolled-back steps netted)."""
        return f"{(job.charged_micros or 0) / 1e6:.6f}"

    @admin.display(description="resumed from step", ordering="resume_checkpoint__step")
    def resumed_from(self, job: Job) -> int | None:
        return job.resume_checkpoint.step if job.resume_checkpoint else None

    @admin.action(description="Cancel: agents drop its stages, its driver stops", permissions=["operate"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        def act(job: Job) -> str:
            job_cancel(job=job, by=f"operator {request.user.get_username()}")
            return "cancelled"

        act_on_each(self, request, queryset, act)

    @admin.action(description="Start / retry (from scratch): queue it for placement", permissions=["operate"])
    def start(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        def act(job: Job) -> str:
            job_start(job=job)
            return "queued for placement (training starts from scratch)"

        act_on_each(self, request, queryset, act)


@admin.register(Stage)
class StageAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
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


@admin.register(LossPoint)
class LossPointAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["job", "step", "epoch", "loss", "samples_per_second"]
    list_select_related = ["job"]
    search_fields = ["job__id", "job__name"]


@admin.register(EpochMetric)
class EpochMetricAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["job", "epoch", "val_loss", "val_accuracy"]
    list_select_related = ["job"]
    search_fields = ["job__id", "job__name"]


class StageCheckpointInline(ReadOnlyInline):
    model = StageCheckpoint
    fields = ["stage_index", "layer_start", "layer_end", "file", "sha256", "size_bytes"]


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["job", "step", "epoch", "generation", "created_at"]
    list_select_related = ["job"]
    search_fields = ["job__id", "job__name"]
    inlines = [StageCheckpointInline]


@admin.register(StageContribution)
class StageContributionAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["job", "stage_index", "generation", "node", "samples", "compute_seconds", "updated_at"]
    list_filter = ["node"]
    list_select_related = ["job", "node"]
    search_fields = ["job__id", "job__name", "node__name"]
