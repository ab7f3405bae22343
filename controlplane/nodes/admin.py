"""Nodes in the admin: read-only pages; pause (drain), resume and clearing a flag call the nodes services."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.timesince import timesince

from controlplane.common.admin import ReadOnlyAdminMixin, act_on_each
from controlplane.nodes.device_class import node_device_class
from controlplane.nodes.models import Node, NodeLease, NodeRestart
from controlplane.nodes.selectors import node_liveness
from controlplane.nodes.services import node_flag_clear, node_set_paused


class NodeLeaseInline(admin.StackedInline):
    model = NodeLease
    can_delete = False
    extra = 0

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


class FlagClearForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        help_text="Recorded on the node with the flag's own reason: why it may take stages again.",
    )


@admin.register(Node)
class NodeAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = [
        "name", "owner", "device_type", "device_class", "ready_status", "flagged", "paused", "heartbeat_age",
        "grpc_address", "reachability",
    ]
    list_filter = [
        "ready_status", "reachability", "paused", ("flagged_at", admin.EmptyFieldListFilter), "device_type", "owner"
    ]
    list_select_related = ["owner", "lease"]
    search_fields = ["id", "name", "grpc_address", "device_name", "owner__username"]
    exclude = ["token_hash"]
    inlines = [NodeLeaseInline]
    actions = ["pause", "resume", "clear_flag"]

    @admin.display(description="flagged", ordering="flagged_at")
    def flagged(self, node: Node) -> str:
        """Why the node was flagged (a failed spot check, or restarting too often), or blank."""
        return node.flag_reason[:120] if node.flagged_at else ""

    @admin.display(description="device class")
    def device_class(self, node: Node) -> str:
        return node_device_class(node) if node.is_registered else ""

    @admin.display(description="last heartbeat")
    def heartbeat_age(self, node: Node) -> str:
        liveness = node_liveness(node)
        return f"{timesince(liveness.renewed_at, timezone.now())} ago" if liveness else "never"

    @admin.action(description="Pause (drain): no new stages; hosted ones move away", permissions=["operate"])
    def pause(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._set_paused(request, queryset, paused=True)

    @admin.action(description="Resume: the node may take stages again", permissions=["operate"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._set_paused(request, queryset, paused=False)

    def _set_paused(self, request: HttpRequest, queryset: QuerySet[Node], *, paused: bool) -> None:
        def act(node: Node) -> str:
            was = node.paused
            node_set_paused(node=node, user=request.user, paused=paused, now=timezone.now())
            if was == paused:
                return f"already {'paused' if paused else 'not paused'}"
            return "paused (draining)" if paused else "resumed"

        act_on_each(self, request, queryset, act)

    @admin.action(
        description="Clear the flag, with a reason: the node may take stages again (withheld credit stays withheld)",
        permissions=["operate"],
    )
    def clear_flag(self, request: HttpRequest, queryset: QuerySet[Node]) -> TemplateResponse | None:
        form = FlagClearForm(request.POST if "apply" in request.POST else None)
        if not form.is_valid():  # first the form asking why; then its answer comes back here
            context = {
                **self.admin_site.each_context(request),
                "title": "Clear the flag of these nodes",
                "opts": self.model._meta,
                "nodes": queryset,
                "form": form,
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(request, "admin/nodes/node/clear_flag.html", context)

        def act(node: Node) -> str:
            flag = node.flag_reason
            if not node_flag_clear(node=node, now=timezone.now(), reason=form.cleaned_data["reason"], by=request.user):
                return "was not flagged; nothing to clear"
            return f"flag cleared ({flag}): {form.cleaned_data['reason'].strip()}"

        act_on_each(self, request, queryset, act)
        return None


@admin.register(NodeRestart)
class NodeRestartAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Append-only evidence: when a node's agent registered again while it hosted a stage."""

    list_display = ["node", "job", "stage_index", "restarted_at"]
    list_select_related = ["node", "job"]
    search_fields = ["node__name", "node__id", "job__id"]


@admin.register(NodeLease)
class NodeLeaseAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["node", "renewed_at", "duration_seconds"]
    list_select_related = ["node"]
    search_fields = ["node__name", "node__id"]
