"""Request and response shapes of the dataset endpoints."""

from __future__ import annotations

from rest_framework import serializers

from arceus.data.formats import DEFAULT_TEXT_COLUMN, FORMATS
from controlplane.common.fields import StrictInputSerializer, StrictIntegerField
from controlplane.datasets.models import Dataset


class DatasetCreateInput(StrictInputSerializer):
    name = serializers.CharField(max_length=200, help_text="a label for you; jobs name the dataset by its id")
    format = serializers.ChoiceField(
        choices=list(FORMATS),
        help_text="text, jsonl or parquet (a text column); safetensors or npz (tensors x and y); tokenizer "
        "(a Hugging Face tokenizer.json)",
    )
    column = serializers.CharField(
        max_length=200, required=False, default=DEFAULT_TEXT_COLUMN, help_text="jsonl/parquet: the text field"
    )
    size_bytes = StrictIntegerField(min_value=1, help_text="the whole file's size")
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$", help_text="the whole file's SHA-256, lowercase hex")


class DatasetPartInput(StrictInputSerializer):
    offset = serializers.IntegerField(min_value=0, help_text="where this piece starts: the dataset's uploaded_bytes")


class DatasetOutput(serializers.ModelSerializer):
    facts = serializers.DictField(
        read_only=True, help_text="what the checked file holds: samples, features, classes; or characters"
    )

    class Meta:
        model = Dataset
        fields = [
            "id", "name", "format", "column", "status", "size_bytes", "sha256", "uploaded_bytes", "facts", "error",
            "created_at", "completed_at",
        ]
        read_only_fields = fields
