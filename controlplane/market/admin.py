from __future__ import annotations

from django.contrib import admin

from controlplane.market.models import LedgerEntry, LedgerHourly, PriceChange, SpotCheck


@admin.register(PriceChange)
class PriceChangeAdmin(admin.ModelAdmin):
    list_display = ["device_class", "price_per_hour", "demand", "supply", "created_at"]
    list_filter = ["device_class"]
    readonly_fields = ["device_class", "price_per_hour", "demand", "supply", "created_at"]


@admin.register(LedgerEntry)
class LedgerEntryAdmin(admin.ModelAdmin):
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

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(LedgerHourly)
class LedgerHourlyAdmin(admin.ModelAdmin):
    list_display = ["hour", "job", "node", "samples", "compute_seconds", "charge_micros", "fee_micros", "credit_micros"]
    list_select_related = ["job", "node"]
    search_fields = ["job__name", "node__name"]


@admin.register(SpotCheck)
class SpotCheckAdmin(admin.ModelAdmin):
    """Append-only evidence: why a node was flagged (a failed check) or trusted (passed ones)."""

    list_display = ["created_at", "job", "node", "stage_index", "step", "micro_batch", "passed", "max_abs_diff",
                    "verifier"]
    list_filter = ["passed", "node"]
    list_select_related = ["job", "node", "verifier"]
    search_fields = ["job__id", "job__name", "node__name", "detail"]
    readonly_fields = [f.name for f in SpotCheck._meta.fields]

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: object, obj: object = None) -> bool:
        return False
