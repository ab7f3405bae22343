"""An exported model's program (arceus.model.exported.program): uploaded by the job's owner before it trains, kept
in checkpoint storage only once it is the program the job's model config names (its SHA-256, each layer's hash)
and every graph passes the operator allow-list; each agent then fetches only the layers of a stage it hosts."""

from __future__ import annotations

import json
import uuid
from typing import Any, BinaryIO

from arceus.errors import SpecError
from arceus.model.exported.program import MAX_PROGRAM_BYTES, program_layers
from arceus.model.registry import architecture_of, model_spec_from_config
from controlplane.common.errors import ApplicationError
from controlplane.common.uploads import HashingReader
from controlplane.jobs.models import Job, checkpoint_storage
from controlplane.jobs.owner_files import hosted_file_layers, job_file_receive


def job_program_receive(*, job: Job, body: BinaryIO, length: int | None) -> Job:
    """Store the `length` bytes of `body` as the job's program (`job_file_receive`), once checked: its hash
    against `model_config.program_sha256`, its layers against their hashes, every operator against the
    allow-list. Only before the job trains; a later upload replaces an earlier one."""
    spec = model_spec_from_config(job.model_config)
    if not architecture_of(spec).ships_program:
        raise ApplicationError.invalid(
            "body", f"a model of type {spec.type!r} has no program; only an exported model (capture()) has one"
        )
    if length is not None and length > MAX_PROGRAM_BYTES:
        raise ApplicationError.invalid(
            "Content-Length", f"{length} bytes is more than the {MAX_PROGRAM_BYTES} a program may hold"
        )

    def check(name: str, reader: HashingReader) -> dict[str, Any]:
        digest = reader.digest.hexdigest()
        if digest != spec.program_sha256:
            raise ApplicationError.invalid(
                "body",
                f"the program's SHA-256 is {digest} but model_config.program_sha256 is {spec.program_sha256}: "
                "upload the program capture() wrote with this model config",
            )
        with checkpoint_storage().open(name, "rb") as handle:
            try:
                program_layers(handle.read(), [layer.sha256 for layer in spec.layers])
            except SpecError as exc:
                raise ApplicationError.invalid(exc.field, exc.message) from exc
        return {"program_sha256": digest}

    return job_file_receive(
        job=job, body=body, length=length, field="program", name=f"programs/{job.id}/{uuid.uuid4()}.json",
        what="the program", one="a program", check=check,
    )


def job_program_layers_for_node(*, node_id: Any, job_id: str, start: Any, end: Any) -> list[str]:
    """The documents of layers [start, end) of a job's program, for a node that hosts a stage holding them."""
    job, first, last = hosted_file_layers(
        node_id=node_id, job_id=job_id, field="program", start=start, end=end, what="program"
    )
    with checkpoint_storage().open(job.program.name, "rb") as handle:
        layers = json.loads(handle.read(MAX_PROGRAM_BYTES + 1))["layers"]  # checked when it was uploaded
    return layers[first:last]
