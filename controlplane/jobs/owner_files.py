"""Files a job's owner uploads before it trains (its initial weights, an exported model's program): streamed into
checkpoint storage and hashed as they arrive, checked, then swapped in under the job's row lock; refused, and
nothing kept, otherwise. And the layers of such a file that a node may fetch: those of a stage it hosts."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

from django.conf import settings
from django.core.files.base import File
from django.db import transaction
from django.db.models import F

from arceus.contracts.status import STARTABLE_STATUSES
from arceus.model.registry import model_spec_from_config
from controlplane.common.errors import ApplicationError
from controlplane.common.uploads import HashingReader, storage_delete
from controlplane.jobs.models import Job, Stage, checkpoint_storage

# What a check of a stored upload answers: the job's fields to set beside the file (its digests).
Check = Callable[[str, HashingReader], dict[str, Any]]


def job_file_receive(
    *, job: Job, body: BinaryIO, length: int | None, field: str, name: str, what: str, one: str, check: Check
) -> Job:
    """Store the `length` bytes of `body` under `name`, run `check(name, reader)` (which raises ApplicationError
    for a file it refuses), then make the file the job's `field` together with the fields `check` returns,
    while the job is still startable; a file it replaces is deleted once that commits. `what` and `one` name
    the file in the refusals ("the program", "a program")."""
    if job.status not in STARTABLE_STATUSES:
        raise ApplicationError.conflict(f"job {job.id} is {job.status}; upload {what} before starting it")
    reader = upload_reader(body, length, what, one)
    stored = checkpoint_storage().save(name, File(reader))
    try:
        if reader.received != length:
            raise ApplicationError.invalid(
                "body", f"the upload ended after {reader.received} of its {length} bytes; send it again"
            )
        fields = check(stored, reader)
        with transaction.atomic():
            locked = Job.objects.select_for_update().filter(pk=job.pk, status__in=STARTABLE_STATUSES).first()
            if locked is None:
                raise ApplicationError.conflict(f"job {job.id} started meanwhile; {what} was not replaced")
            replaced = getattr(locked, field).name
            setattr(locked, field, stored)
            for key, value in fields.items():
                setattr(locked, key, value)
            locked.save(update_fields=[field, *fields])
            if replaced:
                transaction.on_commit(lambda: files_delete([replaced]))
    except BaseException:
        files_delete([stored])
        raise
    return locked


def upload_reader(body: BinaryIO, length: int | None, what: str, one: str) -> HashingReader:
    """A hashing reader of an upload's `length` bytes (its Content-Length) once that is within
    ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES; `what` and `one` name the file in the refusals."""
    limit = settings.ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES
    if length is None or length <= 0:
        raise ApplicationError.invalid("Content-Length", f"send {what}'s size in bytes (more than 0)")
    if length > limit:
        raise ApplicationError.invalid(
            "Content-Length",
            f"{length} bytes is more than the {limit} {one} may hold (ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES)",
        )
    return HashingReader(body, length)


def files_delete(names: Iterable[str]) -> None:
    storage_delete(checkpoint_storage(), names)


def uuid_or_none(value: str) -> str | None:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


def hosted_file_layers(
    *, node_id: Any, job_id: str, field: str, start: Any, end: Any, what: str
) -> tuple[Job, int, int]:
    """The job whose `field` file was uploaded, and layers [start, end) of it (query parameters) that one of the
    node's stages of the job's current generation holds. A stranger (no such job or file, or none of its stages
    on this node) gets a 404 before its query is looked at, learning nothing; a host gets a 400 naming a
    malformed range and a 404 for layers it does not host."""
    job = Job.objects.filter(pk=uuid_or_none(job_id)).exclude(**{field: ""}).first()
    hosted = Stage.objects.filter(job=job, node_id=node_id, active=True, generation=F("job__generation"))
    if job is None or not hosted.exists():
        raise ApplicationError.not_found(f"{what} of job", job_id)
    first, last = _layer_index(start, "start"), _layer_index(end, "end")
    layers = model_spec_from_config(job.model_config).num_layers
    if last <= first:
        raise ApplicationError.invalid("end", f"must be above start ({first}), got {last}")
    if last > layers:
        raise ApplicationError.invalid("end", f"the model has {layers} layers: end is at most {layers}, got {last}")
    if not hosted.filter(layer_start__lte=first, layer_end__gte=last).exists():
        raise ApplicationError.not_found(f"{what} layers of job", f"{job_id} [{first}, {last})")
    return job, first, last


def _layer_index(value: Any, name: str) -> int:
    if not isinstance(value, str) or not value.isdigit() or len(value) > 9:
        raise ApplicationError.invalid(name, f"must be a layer index (0, 1, ...), got {value!r}")
    return int(value)
