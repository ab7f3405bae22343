"""An exported model's program (arceus.model.exported.program): uploaded by the job's owner before it trains, kept
in checkpoint storage only once it is the program the job's model config names (its SHA-256, each layer's hash)
and every graph passes the operator allow-list; each agent then fetches only the layers of a stage it hosts."""

from __future__ import annotations

import json
import uuid
from typing import Any, BinaryIO

from django.core.files.base import File
from django.db import transaction

from arceus.contracts.status import STARTABLE_STATUSES
from arceus.errors import SpecError
from arceus.model.exported.program import MAX_PROGRAM_BYTES, program_layers
from arceus.model.registry import architecture_of, model_spec_from_config
from controlplane.common.errors import ApplicationError
from controlplane.jobs.checkpoints import _delete_files, _upload_reader, _uuid_or_none, hosted_layers
from controlplane.jobs.models import Job, checkpoint_storage


def job_program_receive(*, job: Job, body: BinaryIO, length: int | None) -> Job:
    """Store the `length` bytes of `body` as the job's program, streamed into storage and hashed as they arrive,
    then checked (hash against `model_config.program_sha256`, layers against their hashes, every operator
    against the allow-list); refused, and nothing kept, otherwise. Only before the job trains; a later upload
    replaces an earlier one."""
    spec = model_spec_from_config(job.model_config)
    if not architecture_of(spec).ships_program:
        raise ApplicationError.invalid(
            "body", f"a model of type {spec.type!r} has no program; only an exported model (capture()) has one"
        )
    if job.status not in STARTABLE_STATUSES:
        raise ApplicationError.conflict(f"job {job.id} is {job.status}; upload its program before starting it")
    if length is not None and length > MAX_PROGRAM_BYTES:
        raise ApplicationError.invalid(
            "Content-Length", f"{length} bytes is more than the {MAX_PROGRAM_BYTES} a program may hold"
        )
    reader = _upload_reader(body, length, "the program", "a program")
    storage = checkpoint_storage()
    name = storage.save(f"programs/{job.id}/{uuid.uuid4()}.json", File(reader))
    try:
        if reader.received != length:
            raise ApplicationError.invalid(
                "body", f"the upload ended after {reader.received} of its {length} bytes; send it again"
            )
        digest = reader.digest.hexdigest()
        if digest != spec.program_sha256:
            raise ApplicationError.invalid(
                "body",
                f"the program's SHA-256 is {digest} but model_config.program_sha256 is {spec.program_sha256}: "
                "upload the program capture() wrote with this model config",
            )
        with storage.open(name, "rb") as handle:
            program_layers(handle.read(), [layer.sha256 for layer in spec.layers])
        with transaction.atomic():
            locked = Job.objects.select_for_update().filter(pk=job.pk, status__in=STARTABLE_STATUSES).first()
            if locked is None:
                raise ApplicationError.conflict(f"job {job.id} started meanwhile; its program was not replaced")
            replaced = locked.program.name
            locked.program, locked.program_sha256 = name, digest
            locked.save(update_fields=["program", "program_sha256"])
            if replaced:
                transaction.on_commit(lambda: _delete_files([replaced]))
    except SpecError as exc:
        _delete_files([name])
        raise ApplicationError.invalid(exc.field, exc.message) from exc
    except BaseException:
        _delete_files([name])
        raise
    return locked


def job_program_layers_for_node(*, node_id: Any, job_id: str, start: Any, end: Any) -> list[str]:
    """The documents of layers [start, end) of a job's program, for a node that hosts a stage holding them."""
    job = Job.objects.filter(pk=_uuid_or_none(job_id)).exclude(program="").first()
    first, last = hosted_layers(node_id=node_id, job=job, job_id=job_id, start=start, end=end, what="program")
    assert job is not None  # hosted_layers found a stage of it
    with checkpoint_storage().open(job.program.name, "rb") as handle:
        layers = json.loads(handle.read(MAX_PROGRAM_BYTES + 1))["layers"]  # checked when it was uploaded
    return layers[first:last]
