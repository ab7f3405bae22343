from __future__ import annotations

from django.contrib import admin

from controlplane.nodes.models import Node, NodeLease


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

    @admin.display(description="flagged", ordering="flagged_at")
    def flagged(self, node: Node) -> str:
        """Why a spot check flagged the node (its credit is withheld), or blank."""
        return node.flag_reason[:120] if node.flagged_at else ""

    @admin.display(description="last heartbeat", ordering="lease__renewed_at")
    def last_heartbeat_at(self, node: Node) -> object:
        lease = getattr(node, "lease", None)
        return lease.renewed_at if lease else None


@admin.register(NodeLease)
class NodeLeaseAdmin(admin.ModelAdmin):
    list_display = ["node", "renewed_at", "duration_seconds"]
    list_select_related = ["node"]
    search_fields = ["node__name", "node__id"]
