"""The market in the admin: read-only prices and ledger; "Re-price now" calls the pricing service."""

from __future__ import annotations

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponseRedirect
from django.shortcuts import redirect
from django.urls import URLPattern, path
from django.views.decorators.http import require_POST

from controlplane.common.admin import ReadOnlyAdminMixin
from controlplane.market.models import LedgerEntry, LedgerHourly, PriceChange, SpotCheck
from controlplane.market.services import prices_reprice


@admin.register(PriceChange)
class PriceChangeAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Every posted price; the newest of a class is in force. "Re-price now" posts new ones from the current
    demand and supply instead of waiting for the periodic pass (change_list.html holds the button)."""

    list_display = ["device_class", "price_per_hour", "demand", "supply", "created_at"]
    list_filter = ["device_class"]

    def get_urls(self) -> list[URLPattern]:
        reprice = self.admin_site.admin_view(require_POST(self.reprice_view))
        return [path("reprice/", reprice, name="market_pricechange_reprice"), *super().get_urls()]

    def reprice_view(self, request: HttpRequest) -> HttpResponseRedirect:
        if not self.has_operate_permission(request):
            self.message_user(request, "re-pricing needs the permission to change prices", messages.ERROR)
        else:
            changes = prices_reprice()
            moved = ", ".join(f"{c.device_class} ${c.price_per_hour:.4f}/h" for c in changes) or "no price moved"
            self.message_user(request, f"re-priced: {moved}", messages.SUCCESS)
        return redirect("admin:market_pricechange_changelist")

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):  # noqa: ANN201
        extra_context = {**(extra_context or {}), "can_reprice": self.has_operate_permission(request)}
        return super().changelist_view(request, extra_context)


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Append-only: operators read it, nobody edits it."""

    list_display = [
        "created_at",
        "job",
        "node",
        "stage_index",
        "generation",
        "step",
        "samples",
        "compute_seconds",
        "price_per_hour",
        "charge_micros",
        "fee_micros",
        "credit_micros",
        "withheld",
        "reverses",
    ]
    list_filter = ["withheld", ("reverses", admin.EmptyFieldListFilter), "device_class", "node"]
    list_select_related = ["job", "node"]
    search_fields = ["job__id", "job__name", "node__name"]


@admin.register(LedgerHourly)
class LedgerHourlyAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["hour", "job", "node", "samples", "compute_seconds", "charge_micros", "fee_micros", "credit_micros"]
    list_select_related = ["job", "node"]
    search_fields = ["job__name", "node__name"]


@admin.register(SpotCheck)
class SpotCheckAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Append-only evidence: why a node was flagged (a failed check) or trusted (passed ones)."""

    list_display = ["created_at", "job", "node", "stage_index", "step", "micro_batch", "passed", "max_abs_diff",
                    "verifier"]
    list_filter = ["passed", "node"]
    list_select_related = ["job", "node", "verifier"]
    search_fields = ["job__id", "job__name", "node__name", "detail"]
