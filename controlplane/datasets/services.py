"""A tenant's dataset upload: open it (declaring size and SHA-256, within the tenant's quotas), send its pieces in
order (each stored as it arrives; an interrupted upload resumes from `uploaded_bytes`), complete it (the pieces
joined into one file as they stream, the hash checked, the format checked: arceus.data.formats), delete it.

Pieces are separate storage files because a storage (S3 included) cannot append; completing streams them, a
chunk at a time, into the one file the driver reads, so no request or process holds a dataset whole.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any, BinaryIO

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.core.files.base import File
from django.db import transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone

from arceus.contracts.status import TERMINAL_STATUSES
from arceus.data.formats import DatasetFormatError, check_format, inspect_file
from arceus.safetensors_file import CHUNK_BYTES
from controlplane.common.errors import ApplicationError
from controlplane.common.uploads import HashingReader, storage_delete
from controlplane.datasets.models import Dataset, DatasetStatus, TokenFile, dataset_storage, part_name

log = logging.getLogger(__name__)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SUFFIX = {"text": "txt", "jsonl": "jsonl", "parquet": "parquet", "safetensors": "safetensors", "npz": "npz",
           "tokenizer": "json"}


def dataset_create(
    *, owner: AbstractBaseUser, name: str, format: str, size_bytes: int, sha256: str, column: str = "text"
) -> Dataset:
    """Open an upload of `size_bytes` bytes hashing to `sha256`; 403 past the owner's quotas."""
    try:
        check_format(format)
    except DatasetFormatError as exc:
        raise ApplicationError.invalid("format", str(exc)) from exc
    if not _SHA256.fullmatch(sha256):
        raise ApplicationError.invalid("sha256", "must be the file's SHA-256 as 64 lowercase hex digits")
    if size_bytes <= 0:
        raise ApplicationError.invalid("size_bytes", "must be the file's size in bytes, more than 0")
    with transaction.atomic():
        # One owner's uploads open one at a time, so two cannot both fit the quota's last bytes.
        type(owner).objects.select_for_update().filter(pk=owner.pk).first()
        held = Dataset.objects.filter(owner=owner).exclude(status=DatasetStatus.FAILED).aggregate(
            count=Count("pk"), bytes=Sum("size_bytes")
        )
        count, used = held["count"], held["bytes"] or 0
        if count + 1 > settings.ARCEUS_DATASET_QUOTA_COUNT:
            raise _quota(f"you hold {count} datasets, the most this control plane keeps per tenant "
                         f"(ARCEUS_DATASET_QUOTA_COUNT); delete one first")
        if used + size_bytes > settings.ARCEUS_DATASET_QUOTA_BYTES:
            raise _quota(
                f"{size_bytes:,} more bytes beside your {used:,} would pass your quota of "
                f"{settings.ARCEUS_DATASET_QUOTA_BYTES:,} (ARCEUS_DATASET_QUOTA_BYTES); delete datasets first",
                field="size_bytes",
            )
        return Dataset.objects.create(
            owner=owner, name=name, format=format, column=column, size_bytes=size_bytes, sha256=sha256
        )


def dataset_part_receive(*, dataset: Dataset, offset: int, body: BinaryIO, length: int | None) -> Dataset:
    """Store the `length` bytes of `body` as the piece starting at `offset`, which must be where the upload is
    (409 naming it otherwise: the client resumes from there)."""
    limit = settings.ARCEUS_DATASET_MAX_CHUNK_BYTES
    if length is None or length <= 0:
        raise ApplicationError.invalid("Content-Length", "send the piece's size in bytes (more than 0)")
    if length > limit:
        raise ApplicationError.invalid(
            "Content-Length", f"a piece of {length:,} bytes is more than {limit:,} (ARCEUS_DATASET_MAX_CHUNK_BYTES)"
        )
    with transaction.atomic():
        # The row stays locked while the piece streams: one piece of a dataset is received at a time.
        locked = Dataset.objects.select_for_update().get(pk=dataset.pk)
        if locked.status != DatasetStatus.UPLOADING:
            raise ApplicationError.conflict(f"dataset {dataset.pk} is {locked.status}; its upload is closed")
        if offset != locked.uploaded_bytes:
            raise ApplicationError(
                f"the upload is at byte {locked.uploaded_bytes}; send the piece starting there",
                status=HTTPStatus.CONFLICT,
                errors={"offset": [f"must be {locked.uploaded_bytes}, got {offset}"]},
            )
        if offset + length > locked.size_bytes:
            raise ApplicationError.invalid(
                "Content-Length", f"bytes {offset}..{offset + length} run past the declared size {locked.size_bytes}"
            )
        storage, name = dataset_storage(), part_name(locked, offset)
        if storage.exists(name):  # left by a piece whose request failed after storing it
            storage.delete(name)
        reader = HashingReader(body, length)
        stored = storage.save(name, File(reader))
        if reader.received != length:
            _delete_files([stored])
            raise ApplicationError.invalid(
                "body", f"the piece ended after {reader.received} of its {length} bytes; send it again"
            )
        locked.parts = [*locked.parts, length]
        locked.uploaded_bytes = offset + length
        locked.save(update_fields=["parts", "uploaded_bytes"])
    return locked


def dataset_complete(*, dataset: Dataset) -> Dataset:
    """Join the pieces into the dataset's file, check its hash and format: ready with its facts, or failed
    (400 naming what is wrong; its files deleted, so it no longer counts against the quota)."""
    with transaction.atomic():
        locked = Dataset.objects.select_for_update().get(pk=dataset.pk)
        if locked.status == DatasetStatus.READY:
            return locked  # completing twice is completing once
        if locked.status != DatasetStatus.UPLOADING:
            raise ApplicationError.conflict(f"dataset {dataset.pk} is {locked.status}: {locked.error}")
        if locked.uploaded_bytes != locked.size_bytes:
            raise ApplicationError(
                f"{locked.uploaded_bytes:,} of the {locked.size_bytes:,} bytes have arrived; send the rest first",
                status=HTTPStatus.CONFLICT,
                errors={"offset": [f"the upload is at byte {locked.uploaded_bytes}"]},
            )
        storage = dataset_storage()
        parts = locked.part_names()
        joined = _Joined(storage, parts)
        name = storage.save(f"datasets/{locked.owner_id}/{locked.pk}/data.{_SUFFIX[locked.format]}", File(joined))
        try:
            if joined.digest.hexdigest() != locked.sha256:
                raise DatasetFormatError(
                    f"the file hashes to {joined.digest.hexdigest()}, not the declared {locked.sha256}: "
                    "a piece was damaged; upload the dataset again"
                )
            with storage.open(name, "rb") as handle:
                facts = inspect_file(handle, locked.size_bytes, locked.format, locked.column)
        except DatasetFormatError as exc:
            _delete_files([name, *parts])
            Dataset.objects.filter(pk=locked.pk).update(
                status=DatasetStatus.FAILED, error=str(exc), parts=[], completed_at=timezone.now()
            )
            log.info("dataset %s failed its check: %s", locked.pk, exc)
            failure = ApplicationError.invalid("body", f"dataset {locked.pk} ({locked.format}): {exc}")
        else:
            locked.file, locked.facts, locked.status = name, facts, DatasetStatus.READY
            locked.parts, locked.completed_at = [], timezone.now()
            locked.save(update_fields=["file", "facts", "status", "parts", "completed_at"])
            transaction.on_commit(lambda: _delete_files(parts))
            return locked
    raise failure  # after the commit: the failed state is kept


def dataset_delete(*, dataset: Dataset) -> None:
    """Delete the dataset and its files (a text's token files, and those a tokenizer tokenized); refused (409)
    while a job of its owner that may still train names it."""
    key = str(dataset.pk)
    using = [
        str(job.pk) for job in dataset.owner.jobs.exclude(status__in=TERMINAL_STATUSES).only("dataset_config")
        if key in (job.dataset_config.get("dataset_id"), job.dataset_config.get("tokenizer_id"))
    ]
    if using:
        raise ApplicationError.conflict(f"job {using[0]} may still train on dataset {key}; cancel or delete it first")
    tokens = TokenFile.objects.filter(Q(dataset=dataset) | Q(tokenizer=dataset)).values_list("file", flat=True)
    names = [*([dataset.file.name] if dataset.file else []), *dataset.part_names(), *tokens]
    with transaction.atomic():
        Dataset.objects.filter(pk=dataset.pk).delete()
        transaction.on_commit(lambda: _delete_files(names))


def _quota(message: str, field: str = "quota") -> ApplicationError:
    return ApplicationError(message, status=HTTPStatus.FORBIDDEN, errors={field: [message]})


class _Joined(io.RawIOBase):
    """The pieces read one after another, a chunk at a time, hashed as the storage reads them."""

    def __init__(self, storage: Any, names: list[str]) -> None:
        super().__init__()
        self._storage, self._names, self._current = storage, iter(names), None
        self.digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes (a chunk if unbounded), short only at the end: S3 uploads take a short read for it."""
        n = CHUNK_BYTES if n is None or n < 0 else n
        pieces: list[bytes] = []
        while n > 0:
            if self._current is None:
                name = next(self._names, None)
                if name is None:
                    break
                self._current = self._storage.open(name, "rb")
            data = self._current.read(min(n, CHUNK_BYTES))
            if not data:
                self._current.close()
                self._current = None
                continue
            pieces.append(data)
            n -= len(data)
        data = b"".join(pieces)
        self.digest.update(data)
        return data

    def readable(self) -> bool:
        return True


def _delete_files(names: Iterable[str]) -> None:
    storage_delete(dataset_storage(), names)
