"""An agent's ranged reads of its job's uploaded tensor dataset: stage 0 reads its micro-batches' inputs and the last
stage their labels themselves (nodeagent/step_samples.py), so no training sample passes through the driver.

Who may read what is decided per request from the database, with the node's token: only a node hosting an active
stage of the job's current generation, the first stage (the `x` rows) or the last (the `y` rows), of that job's
dataset, and only byte ranges inside those rows, bounded in count and size (arceus.data.upload_rows). No credential
of its own: a node token is already bound to the node, a stage that moves or rewinds stops reading at once (the
rows are re-read), and nothing a stage could leak reads another job's, let alone another tenant's, dataset.

From a filesystem store the ranges' bytes are answered, read by range; from an S3 bucket, a presigned GET per range
with its Range header signed (SigV4: the URL reads that range of that object only), which the agent fetches itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.db.models import F, Max

from arceus.data.config import UPLOADED_DATASET
from arceus.data.formats import DatasetFormatError
from arceus.data.upload_rows import UploadLayout, ranges_checked, upload_layout
from controlplane.common.direct_transfer import presigned_ranged_get, s3_of
from controlplane.common.errors import ApplicationError
from controlplane.common.uploads import storage_open_ranged
from controlplane.datasets.models import Dataset, DatasetStatus, dataset_storage
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.owner_files import uuid_or_none


@dataclass(frozen=True)
class DatasetRead:
    """What a read answers: the ranges' bytes in order (`chunks`, `size_bytes` of them), or presigned `urls`."""

    size_bytes: int = 0
    chunks: Iterator[bytes] | None = None
    urls: list[str] | None = None


def job_dataset_read_for_node(*, node_id: Any, job_id: str, ranges: Any) -> DatasetRead:
    """Byte ranges `ranges` ([[start, stop], ...]) of job `job_id`'s uploaded tensor dataset, for a node hosting its
    first or last stage. A stranger (no such job, no uploaded tensors, no first or last stage of its current
    generation on this node) gets a 404 before its ranges are looked at; a host gets a 400 naming a malformed,
    oversized or out-of-bounds range (the labels to stage 0, the inputs to the last stage)."""
    job = Job.objects.filter(pk=uuid_or_none(job_id)).first()
    config = job.dataset_config if job is not None else {}
    current = Stage.objects.filter(job=job, active=True, generation=F("job__generation"))
    hosted = set(current.filter(node_id=node_id).values_list("index", flat=True))
    last = current.aggregate(last=Max("index"))["last"]
    reads = ({"x"} if 0 in hosted else set()) | ({"y"} if last in hosted else set())
    if job is None or config.get("name") != UPLOADED_DATASET or not reads:
        raise ApplicationError.not_found("dataset of job", job_id)
    parsed = _ranges(ranges)
    dataset = Dataset.objects.filter(
        pk=config["dataset_id"], owner_id=job.owner_id, status=DatasetStatus.READY
    ).first()
    if dataset is None:
        raise ApplicationError.conflict(f"job {job.id}'s dataset {config['dataset_id']} was deleted")
    layout = _layout(str(dataset.pk), dataset.sha256, dataset.file.name, dataset.format)
    allowed = [(a.offset, a.end) for name, a in (("x", layout.x), ("y", layout.y)) if name in reads]
    try:
        ranges_checked(parsed, allowed)
    except ValueError as exc:
        raise ApplicationError.invalid("ranges", str(exc)) from exc
    target = s3_of(dataset_storage(), dataset.file.name)
    if target is not None:
        return DatasetRead(urls=[presigned_ranged_get(target, start, stop) for start, stop in parsed])
    return DatasetRead(size_bytes=sum(b - a for a, b in parsed), chunks=_read(dataset.file.name, parsed))


def _ranges(value: Any) -> list[tuple[int, int]]:
    if not isinstance(value, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        for r in value
    ):
        raise ApplicationError.invalid("ranges", "must be a list of [start, stop] byte offsets (integers)")
    return [(start, stop) for start, stop in value]


@functools.lru_cache(maxsize=64)
def _layout(dataset_id: str, sha256: str, name: str, fmt: str) -> UploadLayout:
    """The layout of a ready dataset's file (immutable once ready: kept per process by its id and digest)."""
    handle, size = storage_open_ranged(dataset_storage(), name)
    try:
        return upload_layout(dataset_id, handle, size, fmt)
    except DatasetFormatError as exc:  # checked when it was uploaded: the stored file changed since
        raise ApplicationError.conflict(f"dataset {dataset_id}'s stored file is unreadable: {exc}") from exc
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
