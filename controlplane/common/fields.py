"""Serializer fields that take JSON types literally: DRF's own accept "5" and true as numbers."""

from __future__ import annotations

import math
from typing import Any

from rest_framework import serializers


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "Must be a JSON integer (e.g. 5), got {input!r}."}

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid", input=data)
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "Must be a JSON boolean (true or false), got {input!r}."}

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictFloatField(serializers.FloatField):
    """A finite JSON number; `greater_than` and `less_than` are exclusive bounds (a learning rate > 0)."""

    default_error_messages = {
        "invalid": "Must be a finite JSON number (e.g. 0.01), got {input!r}.",
        "not_greater": "Must be greater than {greater_than}, got {input}.",
        "not_less": "Must be less than {less_than}, got {input}.",
    }

    def __init__(self, *, greater_than: float | None = None, less_than: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.greater_than = greater_than
        self.less_than = less_than

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, int | float) or not math.isfinite(data):
            self.fail("invalid", input=data)
        value = super().to_internal_value(data)
        if self.greater_than is not None and value <= self.greater_than:
            self.fail("not_greater", greater_than=self.greater_than, input=data)
        if self.less_than is not None and value >= self.less_than:
            self.fail("not_less", less_than=self.less_than, input=data)
        return value


class StrictInputSerializer(serializers.Serializer):
    """Rejects keys it does not know, so a misspelt option is an error rather than silently ignored."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                allowed = ", ".join(sorted(self.fields))
                raise serializers.ValidationError(
                    {key: [f"Unknown field; allowed fields: {allowed}."] for key in unknown}
                )
        return super().to_internal_value(data)
