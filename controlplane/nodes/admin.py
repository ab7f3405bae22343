from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from controlplane.nodes.models import Node, NodeLease, NodeRestart
from controlplane.nodes.services import node_flag_clear


class NodeLeaseInline(admin.StackedInline):
    model = NodeLease
    can_delete = False
    readonly_fields = ["renewed_at", "duration_seconds"]
    extra = 0


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = [
        "name", "owner", "device_type", "ready_status", "paused", "flagged", "grpc_address", "last_heartbeat_at"
    ]
    list_filter = ["ready_status", "paused", ("flagged_at", admin.EmptyFieldListFilter), "device_type", "owner"]
    list_select_related = ["owner", "lease"]
    search_fields = ["id", "name", "grpc_address", "device_name", "owner__username"]
    readonly_fields = [
        "id", "token_hash", "public_key", "tls_certificate", "registered_at", "ready_transition_at", "paused_at",
        "created_at", "flagged_at", "flag_reason",
    ]
    inlines = [NodeLeaseInline]
    actions = ["clear_flag"]

    @admin.display(description="flagged", ordering="flagged_at")
    def flagged(self, node: Node) -> str:
        """Why the node was flagged (a failed spot check, or restarting too often), or blank."""
        return node.flag_reason[:120] if node.flagged_at else ""

    @admin.action(description="Clear the flag: the node may take stages again (withheld credit stays withheld)")
    def clear_flag(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        now = timezone.now()
        cleared = sum(node_flag_clear(node=node, now=now) for node in queryset)
        self.message_user(request, f"cleared the flag of {cleared} node(s)", messages.SUCCESS)

    @admin.display(description="last heartbeat", ordering="lease__renewed_at")
    def last_heartbeat_at(self, node: Node) -> object:
        lease = getattr(node, "lease", None)
        return lease.renewed_at if lease else None


@admin.register(NodeRestart)
class NodeRestartAdmin(admin.ModelAdmin):
    """Append-only evidence: when a node's agent registered again while it hosted a stage."""

    list_display = ["node", "job", "stage_index", "restarted_at"]
    list_select_related = ["node", "job"]
    search_fields = ["node__name", "node__id", "job__id"]
    readonly_fields = ["node", "job", "stage_index", "restarted_at", "created_at"]


@admin.register(NodeLease)
class NodeLeaseAdmin(admin.ModelAdmin):
    list_display = ["node", "renewed_at", "duration_seconds"]
    list_select_related = ["node"]
    search_fields = ["node__name", "node__id"]
