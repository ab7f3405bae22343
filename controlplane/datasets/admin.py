"""Datasets in the admin: tenants' uploads, their state and facts (read-only, as every admin page)."""

from __future__ import annotations

from django.contrib import admin

from controlplane.common.admin import ReadOnlyAdminMixin
from controlplane.datasets.models import Dataset


@admin.register(Dataset)
class DatasetAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["name", "owner", "format", "status", "size_bytes", "uploaded_bytes", "created_at"]
    list_filter = ["status", "format"]
    search_fields = ["name", "owner__username", "sha256"]
