"""Base model: UUID primary keys (ids are safe to show and to mint anywhere) and a creation time."""

from __future__ import annotations

import uuid

from django.db import models


class BaseModel(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        abstract = True
