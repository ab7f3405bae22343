"""An agent's ranged reads of its job's upload: stage 0 reads its micro-batches' inputs and the last stage their
labels themselves (nodeagent/step_samples.py), so no training sample passes through the driver. The file read is
the job's uploaded tensor file, or its uploaded text's token file for the job's tokenizer (written once by the
control plane before the job's first step: controlplane/datasets/tokens.py).

Who may read what is decided per request from the database, with the node's token: only a node hosting an active
stage of the job's current generation, the first stage (the `x` rows) or the last (the `y` rows), of that job's
file, and only byte ranges inside those rows, bounded in count and size (arceus.data.upload_rows). No credential
of its own: a node token is already bound to the node, a stage that moves or rewinds stops reading at once (the
rows are re-read), and nothing a stage could leak reads another job's file, let alone another tenant's.

From a filesystem store the ranges' bytes are answered, read by range; from an S3 bucket, a presigned GET per range
with its Range header signed (SigV4: the URL reads that range of that object only), which the agent fetches itself.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.db.models import F, Max

from arceus.data.config import UPLOADED_DATASET
from arceus.data.formats import DatasetFormatError
from arceus.data.text_config import TEXT_DATASET
from arceus.data.token_file import token_file_key
from arceus.data.upload_rows import UploadLayout, layout_of, ranges_checked
from arceus.errors import SpecError
from controlplane.common.direct_transfer import presigned_ranged_get, s3_of
from controlplane.common.errors import ApplicationError
from controlplane.common.uploads import storage_open_ranged
from controlplane.datasets.models import Dataset, DatasetStatus, TokenFile, dataset_storage
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.owner_files import uuid_or_none

# What a file's layout depends on in a job's dataset config (arceus.data.upload_rows.layout_of).
_LAYOUT_KEYS = ("name", "dataset_id", "format", "block_size")


@dataclass(frozen=True)
class DatasetRead:
    """What a read answers: the ranges' bytes in order (`chunks`, `size_bytes` of them), or presigned `urls`."""

    size_bytes: int = 0
    chunks: Iterator[bytes] | None = None
    urls: list[str] | None = None


def job_dataset_read_for_node(*, node_id: Any, job_id: str, ranges: Any) -> DatasetRead:
    """Byte ranges `ranges` ([[start, stop], ...]) of job `job_id`'s upload (tensor file or token file), for a node
    hosting its first or last stage. A stranger (no such job, no upload, no first or last stage of its current
    generation on this node) gets a 404 before its ranges are looked at; a host gets a 400 naming a malformed,
    oversized or out-of-bounds range (the labels to stage 0, the inputs to the last stage)."""
    job = Job.objects.filter(pk=uuid_or_none(job_id)).first()
    config = job.dataset_config if job is not None else {}
    current = Stage.objects.filter(job=job, active=True, generation=F("job__generation"))
    hosted = set(current.filter(node_id=node_id).values_list("index", flat=True))
    last = current.aggregate(last=Max("index"))["last"]
    reads = ({"x"} if 0 in hosted else set()) | ({"y"} if last in hosted else set())
    if job is None or config.get("name") not in (UPLOADED_DATASET, TEXT_DATASET) or "dataset_id" not in config \
            or not reads:
        raise ApplicationError.not_found("dataset of job", job_id)
    parsed = _ranges(ranges)
    name, version = _stored(job, config)
    layout = _layout(name, version, json.dumps({k: config.get(k) for k in _LAYOUT_KEYS}))
    allowed = [(a.offset, a.end) for read in sorted(reads) for a in layout.arrays(read)]
    try:
        ranges_checked(parsed, allowed)
    except ValueError as exc:
        raise ApplicationError.invalid("ranges", str(exc)) from exc
    target = s3_of(dataset_storage(), name)
    if target is not None:
        return DatasetRead(urls=[presigned_ranged_get(target, start, stop) for start, stop in parsed])
    return DatasetRead(size_bytes=sum(b - a for a, b in parsed), chunks=_read(name, parsed))


def _stored(job: Job, config: dict[str, Any]) -> tuple[str, str]:
    """(the stored file's name, what identifies its version) of the job's upload: its tensor file (its digest), or
    its text's token file for the job's tokenizer (its row's id); 409 where it was deleted or is not written yet."""
    dataset = Dataset.objects.filter(
        pk=config["dataset_id"], owner_id=job.owner_id, status=DatasetStatus.READY
    ).first()
    if dataset is None:
        raise ApplicationError.conflict(f"job {job.id}'s dataset {config['dataset_id']} was deleted")
    if config["name"] == UPLOADED_DATASET:
        return dataset.file.name, dataset.sha256
    tokens = TokenFile.objects.filter(dataset=dataset, key=token_file_key(config)).first()
    if tokens is None:
        raise ApplicationError.conflict(f"job {job.id}'s dataset {dataset.pk} is not tokenized yet: its driver "
                                        "tokenizes it before the first step")
    return tokens.file.name, str(tokens.pk)


def _ranges(value: Any) -> list[tuple[int, int]]:
    if not isinstance(value, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        for r in value
    ):
        raise ApplicationError.invalid("ranges", "must be a list of [start, stop] byte offsets (integers)")
    return [(start, stop) for start, stop in value]


@functools.lru_cache(maxsize=64)
def _layout(name: str, version: str, config_json: str) -> UploadLayout:
    """The layout of a stored file for the config's `_LAYOUT_KEYS` (immutable once written: kept per process by its
    version)."""
    config = json.loads(config_json)
    handle, size = storage_open_ranged(dataset_storage(), name)
    try:
        return layout_of(config, handle, size)
    except (DatasetFormatError, SpecError) as exc:  # checked when it was written: the stored file changed since
        raise ApplicationError.conflict(f"dataset {config['dataset_id']}'s stored file is unreadable: {exc}") from exc
    finally:
        handle.close()


def _read(name: str, ranges: list[tuple[int, int]]) -> Iterator[bytes]:
    """The bytes of `ranges` of a stored file, in order, a range at a time (each at most MAX_RANGE_BYTES)."""
    handle, _ = storage_open_ranged(dataset_storage(), name)
    try:
        for start, stop in ranges:
            handle.seek(start)
            data = handle.read(stop - start)
            if len(data) != stop - start:
                raise OSError(f"the stored dataset ends inside [{start}, {stop})")
            yield data
    finally:
        handle.close()
