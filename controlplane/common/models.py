"""Base model: UUID primary keys (ids are safe to show and to mint anywhere) and a creation time."""

from __future__ import annotations

import uuid
from enum import StrEnum

from django.db import models


class BaseModel(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        abstract = True


def enum_choices(enum: type[StrEnum]) -> list[tuple[str, str]]:
    """A contracts enum as a field's choices, labelled as Django's TextChoices would label them."""
    return [(member.value, member.name.replace("_", " ").title()) for member in enum]
