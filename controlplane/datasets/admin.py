"""Datasets in the admin: tenants' uploads, their state and facts, and the token files of their texts (read-only,
as every admin page)."""

from __future__ import annotations

from django.contrib import admin

from controlplane.common.admin import ReadOnlyAdminMixin
from controlplane.datasets.models import Dataset, TokenFile


@admin.register(Dataset)
class DatasetAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["name", "owner", "format", "status", "size_bytes", "uploaded_bytes", "created_at"]
    list_filter = ["status", "format"]
    search_fields = ["name", "owner__username", "sha256"]


@admin.register(TokenFile)
class TokenFileAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["dataset", "key", "size_bytes", "created_at"]
    search_fields = ["dataset__name", "dataset__owner__username", "key"]
