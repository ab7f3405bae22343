"""Uploaded datasets: a tenant's file sent in pieces, checked whole, then named by jobs (`dataset_id`)."""

from __future__ import annotations

from django.conf import settings
from django.core.files.storage import Storage, storages
from django.db import models

from arceus.data.formats import DEFAULT_TEXT_COLUMN, FORMATS
from controlplane.common.models import BaseModel


def dataset_storage() -> Storage:
    """The "datasets" storage of settings.STORAGES (the checkpoints' place by default, filesystem or S3)."""
    return storages["datasets"]


class DatasetStatus(models.TextChoices):
    UPLOADING = "uploading"  # pieces arrive in order; `uploaded_bytes` is where the next one starts
    READY = "ready"  # whole, its hash matched, its format checked: jobs may name it
    FAILED = "failed"  # the whole file did not check (`error` says why); its files are gone


class Dataset(BaseModel):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    format = models.CharField(max_length=16, choices=[(f, f) for f in FORMATS])
    column = models.CharField(max_length=200, default=DEFAULT_TEXT_COLUMN, help_text="jsonl/parquet: the text field")
    size_bytes = models.BigIntegerField(help_text="The whole file's size, declared when the upload opens.")
    sha256 = models.CharField(max_length=64, help_text="The whole file's SHA-256, declared when the upload opens.")
    status = models.CharField(max_length=16, choices=DatasetStatus.choices, default=DatasetStatus.UPLOADING)
    # The pieces received so far, in order: their sizes (each stored as its own file until the upload completes).
    uploaded_bytes = models.BigIntegerField(default=0)
    parts = models.JSONField(default=list, blank=True)
    file = models.FileField(storage=dataset_storage, max_length=300, blank=True)
    facts = models.JSONField(default=dict, blank=True, help_text="What the checked file holds (arceus.data.formats).")
    error = models.TextField(blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["owner", "status"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.format}, {self.status})"

    def part_names(self) -> list[str]:
        """The stored pieces' names, in order (each named by the offset it starts at)."""
        offsets = [sum(self.parts[:i]) for i in range(len(self.parts))]
        return [part_name(self, offset) for offset in offsets]


def part_name(dataset: Dataset, offset: int) -> str:
    return f"datasets/{dataset.owner_id}/{dataset.pk}/parts/{offset:016d}"


class TokenFile(BaseModel):
    """An uploaded text tokenized once per tokenizer (arceus.data.token_file), stored beside it in the datasets'
    storage: every job naming that text and tokenizer reads its windows, stages by byte range."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="token_files")
    # The uploaded tokenizer.json it was tokenized by, if one was (deleting either deletes the token file).
    tokenizer = models.ForeignKey(Dataset, on_delete=models.CASCADE, null=True, blank=True, related_name="+")
    key = models.CharField(max_length=100, help_text="What its tokens depend on besides the text: token_file_key.")
    file = models.FileField(storage=dataset_storage, max_length=300)
    size_bytes = models.BigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["dataset", "key"], name="one_token_file_per_tokenizer")]

    def __str__(self) -> str:
        return f"{self.dataset_id} tokenized by {self.key}"


def token_file_name(dataset: Dataset, key: str) -> str:
    return f"datasets/{dataset.owner_id}/{dataset.pk}/tokens/{key}.tok"
