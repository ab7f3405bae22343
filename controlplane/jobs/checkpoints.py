"""Coordinated checkpoints: saved by the job's driver, fetched by agents, assembled for the owner; and a job's
uploaded initial weights (fine-tuning), which its agents fetch as they would a checkpoint.

Files go through the "checkpoints" storage (settings.STORAGES). An unsplit stage's agent uploads its own
file (the driver opens a CheckpointUpload for it, the agent PUTs the file to the control plane, which
stores it as it arrives; with an S3 bucket the agent sends it there in presigned parts and the control plane
only signs, completes and checks it (an interrupted upload resumes: a start answers the parts stored, and the
agent sends the others; one abandoned is aborted when its upload is withdrawn: by the job's next checkpoint or
its end), and a resuming agent downloads it by a presigned URL): the state never
passes through the driver. Rows are written only once every stage's file is stored, in one transaction guarded
by the driver lease, so a checkpoint in the database is always complete and always from the driver that owned
the job at the time.

An agent is a stranger's process: every stage file, uploaded or streamed by the driver, is checked from its
header against exactly what that stage holds (`arceus.model.expected_state`) before it is kept, so what a
resume loads, the model its owner downloads and what sampling runs are only the stage's own tensors.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from django.conf import settings
from django.core.files.base import File
from django.db import transaction
from django.db.models import Max, QuerySet

from arceus.contracts.spot_check import PARTIAL_GRADIENT
from arceus.errors import SpecError
from arceus.model.expected_state import ExpectedState, expected_stage_state, optimizer_kind, stage_file_check
from arceus.model.hugging_face import (
    hugging_face_folder,
    hugging_face_format,
    hugging_face_weights_check,
    initial_weights_layer_digests,
    initial_weights_names,
    initial_weights_slice,
)
from arceus.model.registry import model_spec_from_config
from arceus.safetensors_file import (
    BUFFER_PREFIX,
    OPTIMIZER_PREFIX,
    CheckpointError,
    StageStateError,
    file_digest,
    merged_checkpoint,
)
from arceus.training.plan import StageEndpoint, StageStateFile
from controlplane.common import metrics
from controlplane.common.direct_transfer import (
    MultipartUpload,
    multipart_abort,
    multipart_complete,
    multipart_start,
    presigned_get,
    s3_of,
)
from controlplane.common.errors import ApplicationError
from controlplane.common.uploads import HashingReader, storage_open_ranged
from controlplane.datasets.selectors import dataset_open
from controlplane.jobs.leases import held, job_checkpointed
from controlplane.jobs.models import Checkpoint, CheckpointUpload, Job, Stage, StageCheckpoint, checkpoint_storage
from controlplane.jobs.owner_files import (
    files_delete,
    hosted_file_layers,
    job_file_receive,
    upload_reader,
    uuid_or_none,
)

log = logging.getLogger(__name__)
# Checkpoints kept per job besides the one its stages resume from and those a rollback could need
# (`checkpoint_trusted` of each placed node): older ones are deleted.
KEEP_CHECKPOINTS = 2


def checkpoint_uploads_open(
    *, job_id: Any, lease_owner: str, generation: int, step: int, stages: Sequence[StageEndpoint]
) -> dict[int, CheckpointUpload] | None:
    """An upload by stage index for each of these (unsplit) stages, from the node that hosts it, for the
    checkpoint of `step`; None (and nothing opened) if the caller no longer holds the job's driver lease at
    `generation`. An upload still open for the same stage on the same node at this step (the driver tries the
    checkpoint again after losing a replica) is kept, so its agent resumes what it sent of it; every other upload
    of the job (an earlier checkpoint's that never completed: its driver died) goes, with its files."""
    with transaction.atomic():
        job = held(job_id, lease_owner).filter(generation=generation).select_for_update().first()
        if job is None:
            return None
        wanted = {(s.index, s.node_id, s.layer_start, s.layer_end): s for s in stages}
        kept = {
            u.stage_index: u
            for u in CheckpointUpload.objects.filter(job=job, file="", step=step, generation=generation)
            if (u.stage_index, str(u.node_id), u.layer_start, u.layer_end) in wanted
        }
        _uploads_delete(CheckpointUpload.objects.filter(job=job).exclude(pk__in=[u.pk for u in kept.values()]))
        created = CheckpointUpload.objects.bulk_create(
            CheckpointUpload(
                job=job, node_id=stage.node_id, stage_index=stage.index, layer_start=stage.layer_start,
                layer_end=stage.layer_end, step=step, generation=generation,
            )
            for stage in sorted(stages, key=lambda s: s.index) if stage.index not in kept
        )
    return {**kept, **{u.stage_index: u for u in created}}


def checkpoint_uploads_withdraw(*, job: Job) -> None:
    """Withdraw the job's open uploads (it ended): their files go, and the multipart uploads their agents left
    open in an S3 bucket are aborted, so no part stays stored unseen."""
    _uploads_delete(CheckpointUpload.objects.filter(job=job))


def checkpoint_upload_receive(*, node_id: Any, upload_id: str, body: BinaryIO, length: int | None) -> CheckpointUpload:
    """Store the `length` bytes of `body` as the state file of an open upload of this node's, a chunk at a
    time, hashing it as it arrives; the file must hold exactly the stage's state (checked from its header;
    refused, and nothing kept, otherwise). An upload is received once."""
    upload = _upload_of_node(node_id, upload_id)
    reader = upload_reader(body, length, "the state file", "a stage's state file")
    storage = checkpoint_storage()
    name = storage.save(_upload_name(upload), File(reader))
    return _upload_keep(upload, name, length, reader.digest.hexdigest(), arrived=reader.received)


def checkpoint_upload_direct_start(*, node_id: Any, upload_id: str, size_bytes: Any) -> MultipartUpload | None:
    """Where the agent PUTs the parts of its `size_bytes`-byte state file for an open upload of its node's,
    straight into the S3 bucket (`controlplane.common.direct_transfer`), and which parts the bucket already holds
    of it when its agent was interrupted before (it sends only the others); None when the checkpoint storage is
    no S3 bucket: the agent then PUTs the file to the control plane (checkpoint_upload_receive)."""
    upload = _upload_of_node(node_id, upload_id)
    if not isinstance(size_bytes, int) or not 0 < size_bytes <= settings.ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES:
        raise ApplicationError.invalid(
            "size_bytes", f"a stage's state file has 1 to {settings.ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES} bytes"
        )
    target = s3_of(checkpoint_storage(), _upload_name(upload))
    return None if target is None else multipart_start(target, size_bytes)


def checkpoint_upload_direct_complete(
    *, node_id: Any, upload_id: str, multipart_id: Any, sha256: Any, size_bytes: Any
) -> CheckpointUpload:
    """Complete the multipart upload the agent sent its parts to and keep the object as the upload's state file,
    checked as a PUT one is: every part of a file of `size_bytes` stored (a 409 names those missing), its size as
    the bucket answers it the `size_bytes` the agent declares, its header exactly the stage's state (both read from
    the bucket by range: a few KiB). The bytes never reach the
    control plane, so their digest is the agent's `sha256`; the driver checks it against what the agent reported
    to it, and the agent that loads the checkpoint checks the bytes against it."""
    upload = _upload_of_node(node_id, upload_id)
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ApplicationError.invalid("sha256", "the file's SHA-256 is 64 lowercase hex digits")
    if not isinstance(multipart_id, str) or not multipart_id:
        raise ApplicationError.invalid("multipart_id", "name the multipart upload this upload's start answered")
    name = _upload_name(upload)
    target = s3_of(checkpoint_storage(), name)
    if target is None:
        raise ApplicationError.conflict("the checkpoint storage is no S3 bucket: PUT the file to this upload")
    if not isinstance(size_bytes, int) or size_bytes < 1:
        raise ApplicationError.invalid("size_bytes", "the size of the file sent, in bytes")
    size = multipart_complete(target, multipart_id, size_bytes)
    return _upload_keep(upload, name, size_bytes, sha256, arrived=size)


def checkpoint_upload_direct_abort(*, node_id: Any, upload_id: str, multipart_id: str) -> None:
    """Abort a multipart upload of an open upload of this node's: its parts go from the bucket."""
    upload = _upload_of_node(node_id, upload_id)
    target = s3_of(checkpoint_storage(), _upload_name(upload))
    if target is not None:
        multipart_abort(target, multipart_id)


def _upload_of_node(node_id: Any, upload_id: str) -> CheckpointUpload:
    """An upload this node may send: opened for it and not yet received (a stranger's does not exist for it)."""
    upload = CheckpointUpload.objects.select_related("job").filter(pk=uuid_or_none(upload_id), node_id=node_id).first()
    if upload is None:
        raise ApplicationError.not_found("checkpoint upload", upload_id)
    if upload.file:
        raise ApplicationError.conflict(f"checkpoint upload {upload_id} was already received")
    return upload


def _upload_name(upload: CheckpointUpload) -> str:
    return f"checkpoints/{upload.job_id}/step-{upload.step:08d}/stage-{upload.stage_index}-{upload.pk}.safetensors"


def _upload_keep(upload: CheckpointUpload, name: str, length: Any, sha256: str, *, arrived: int) -> CheckpointUpload:
    """Keep the stored file `name` (`arrived` bytes, hashing to `sha256`) as the upload's, if it is the `length`
    bytes declared and holds exactly the stage's state (checked from its header); deleted otherwise."""
    storage = checkpoint_storage()
    try:
        if arrived != length:
            raise ApplicationError.invalid(
                "body", f"{arrived} bytes arrived of the {length} declared; send it again"
            )
        expected = _expected_state(upload.job, upload.stage_index, upload.layer_start, upload.layer_end)
        handle, _ = storage_open_ranged(storage, name)
        with handle:
            stage_file_check(handle, arrived, expected)
        updated = CheckpointUpload.objects.filter(pk=upload.pk, file="").update(
            file=name, sha256=sha256, size_bytes=arrived
        )
        if not updated:  # received meanwhile, or withdrawn by a newer checkpoint
            raise ApplicationError.conflict(f"checkpoint upload {upload.pk} is no longer open")
    except CheckpointError as exc:
        files_delete([name])
        raise ApplicationError.invalid("body", str(exc)) from exc
    except BaseException:
        files_delete([name])
        raise
    upload.refresh_from_db()
    return upload


@metrics.CHECKPOINT_SECONDS.time()
def checkpoint_save(
    *, job_id: Any, lease_owner: str, generation: int, step: int, epoch: int, stages: Sequence[StageStateFile]
) -> Checkpoint | None:
    """Store every stage's state after `step`: a file the driver streamed is checked against what its stage
    holds, then copied into the checkpoint storage a chunk at a time; an upload (checked as it arrived) must
    have arrived whole, as the agent says it sent it, for the stage's layers. StageStateError naming the
    stage whose file is refused. None (and nothing kept) if the caller no longer holds the job's driver
    lease at `generation`. Resets the job's restart count: the job made progress."""
    storage = checkpoint_storage()
    stored: list[tuple[StageStateFile, str]] = []
    uploads = _received_uploads(job_id, generation, step, [s for s in stages if s.path is None])
    job = Job.objects.only("model_config", "optimizer", "momentum").filter(pk=job_id).first()
    if job is None:  # deleted: no lease to hold
        return None
    try:
        for stage in stages:
            if stage.path is None:
                stored.append((stage, uploads[stage.upload_id].file.name))
                continue
            with stage.path.open("rb") as handle:
                expected = _expected_state(job, stage.index, stage.layer_start, stage.layer_end)
                stage_file_check(handle, stage.path.stat().st_size, expected)
                name = storage.save(
                    f"checkpoints/{job_id}/step-{step:08d}/stage-{stage.index}.safetensors", File(handle)
                )
            stored.append((stage, name))
        with transaction.atomic():
            job = held(job_id, lease_owner).filter(generation=generation).select_for_update().first()
            if job is None:
                raise _LeaseLost
            # A replay after a rewind may reach a step saved before (resuming from the final checkpoint
            # saves it again): the newer save replaces it, also as the checkpoint the job resumes from.
            replaced = Checkpoint.objects.filter(job=job, step=step).first()
            if replaced is not None:
                checkpoints_delete([replaced])
            checkpoint = Checkpoint.objects.create(job=job, step=step, epoch=epoch, generation=generation)
            StageCheckpoint.objects.bulk_create(
                StageCheckpoint(
                    checkpoint=checkpoint,
                    stage_index=stage.index,
                    layer_start=stage.layer_start,
                    layer_end=stage.layer_end,
                    file=name,
                    sha256=stage.sha256,
                    size_bytes=stage.size_bytes,
                )
                for stage, name in stored
            )
            CheckpointUpload.objects.filter(pk__in=[u.pk for u in uploads.values()]).delete()  # files kept
            job_checkpointed(job=job, checkpoint_id=checkpoint.pk, replaced_id=replaced.pk if replaced else None)
            keep = {checkpoint.pk, job.resume_checkpoint_id} | _rollback_targets(job)
            old = Checkpoint.objects.filter(job=job).exclude(pk__in=keep - {None}).order_by("-step")
            checkpoints_delete(old[KEEP_CHECKPOINTS - 1 :])
    except _LeaseLost:
        files_delete(name for _, name in stored)
        return None
    except BaseException:
        files_delete(name for _, name in stored)
        raise
    metrics.CHECKPOINT_BYTES.observe(sum(stage.size_bytes for stage in stages))
    return checkpoint


def _received_uploads(
    job_id: Any, generation: int, step: int, stages: Sequence[StageStateFile]
) -> dict[str, CheckpointUpload]:
    """The uploads these stages' agents say they sent, by id: each must be of this job's checkpoint of `step`
    in `generation`, for that stage and its layers, and have arrived with the hash and size the agent
    reports."""
    ids = [uuid_or_none(s.upload_id) for s in stages]
    found = {str(u.pk): u for u in CheckpointUpload.objects.filter(pk__in=[i for i in ids if i], job_id=job_id)}
    for stage in stages:
        upload = found.get(stage.upload_id)
        opened_for = None if upload is None else (
            upload.stage_index, upload.layer_start, upload.layer_end, upload.step, upload.generation
        )
        if upload is None or opened_for != (stage.index, stage.layer_start, stage.layer_end, step, generation):
            raise StageStateError(f"no upload {stage.upload_id} was opened for step {step}", stage_index=stage.index)
        if not upload.file:
            raise StageStateError("its agent reports an upload the control plane never received",
                                  stage_index=stage.index)
        if (upload.sha256, upload.size_bytes) != (stage.sha256, stage.size_bytes):
            raise StageStateError(
                f"the control plane received {upload.size_bytes} bytes hashing to {upload.sha256}, but the agent "
                f"sent {stage.size_bytes} bytes hashing to {stage.sha256}",
                stage_index=stage.index,
            )
    return found


def _expected_state(job: Job, stage_index: int, layer_start: int, layer_end: int) -> ExpectedState:
    """What the state file of stage `stage_index` of `job`, holding layers [layer_start, layer_end), must be."""
    return expected_stage_state(
        model_spec_from_config(job.model_config), stage_index=stage_index, layer_start=layer_start,
        layer_end=layer_end, optimizer=optimizer_kind(job.optimizer, job.momentum),
    )


def _uploads_delete(uploads: QuerySet[CheckpointUpload]) -> None:
    """Delete uploads and, once the transaction commits, their files and the multipart uploads their agents left
    open in an S3 bucket (an agent that died mid-upload)."""
    names = [n for n in uploads.values_list("file", flat=True) if n]
    unreceived = [_upload_name(u) for u in uploads.filter(file="")]
    uploads.delete()
    transaction.on_commit(lambda: files_delete(names))
    transaction.on_commit(lambda: _multipart_uploads_abort(unreceived))


def _multipart_uploads_abort(names: list[str]) -> None:
    storage = checkpoint_storage()
    for name in names:
        if (target := s3_of(storage, name)) is not None:
            multipart_abort(target)


def checkpoint_trusted(*, job: Job, node_ids: Collection[str]) -> Checkpoint | None:
    """The newest checkpoint that each of these nodes' work up to has passed a spot check: one of the
    node's checks passed at the checkpoint's step or later, in the checkpoint's generation or later (a
    check of a run that was rewound past it does not vouch for the replay); of a replicated job, also one of
    its partial gradients. None: nothing is vouched for, so a rollback trains from the initial weights
    (uploaded, else seeded)."""
    passed = job.spot_checks.filter(node_id__in=list(node_ids), passed=True)
    kinds = [passed]
    if job.replicated:
        # A replica's partial gradient went into every replica's weights: only a check of it vouches for them.
        kinds.append(passed.filter(kind=PARTIAL_GRADIENT))
    reaches = []
    for checks in kinds:
        reach: dict[str, list[tuple[int, int]]] = defaultdict(list)  # node -> [(generation, newest step)]
        for row in checks.values("node_id", "generation").annotate(newest=Max("train_step")):
            reach[str(row["node_id"])].append((row["generation"], row["newest"]))
        reaches.append(reach)
    for checkpoint in job.checkpoints.order_by("-step"):
        if all(
            any(g >= checkpoint.generation and s >= checkpoint.step for g, s in reach[str(n)])
            for reach in reaches for n in node_ids
        ):
            return checkpoint
    return None


def _rollback_targets(job: Job) -> set[Any]:
    """The checkpoint each node placed in the job would roll back to if it were caught now."""
    nodes = job.stages.filter(active=True, node__isnull=False).values_list("node_id", flat=True)
    targets = (checkpoint_trusted(job=job, node_ids=[str(n)]) for n in nodes)
    return {t.pk for t in targets if t is not None}


def checkpoints_delete(checkpoints: QuerySet[Checkpoint] | Iterable[Checkpoint]) -> None:
    """Delete checkpoints and, once the transaction commits, their files."""
    checkpoints = list(checkpoints)
    if not checkpoints:
        return
    names = list(StageCheckpoint.objects.filter(checkpoint__in=checkpoints).values_list("file", flat=True))
    Checkpoint.objects.filter(pk__in=[c.pk for c in checkpoints]).delete()
    transaction.on_commit(lambda: files_delete(names))


def stage_checkpoint_for_node(*, node_id: Any, stage_checkpoint_id: str) -> StageCheckpoint:
    """A stage checkpoint the node may download: the node must host that stage of that job now."""
    sc = StageCheckpoint.objects.select_related("checkpoint").filter(pk=uuid_or_none(stage_checkpoint_id)).first()
    if sc is None or not Stage.objects.filter(
        job_id=sc.checkpoint.job_id, index=sc.stage_index, node_id=node_id, active=True
    ).exists():
        raise ApplicationError.not_found("checkpoint", stage_checkpoint_id)
    return sc


def stage_checkpoint_url(sc: StageCheckpoint) -> str | None:
    """A presigned URL the agent GETs the stage checkpoint's file from, straight from the S3 bucket; None when
    the checkpoint storage is no S3 bucket (the control plane then serves it: stage_checkpoint_open). The file's
    bytes count in arceus_checkpoint_bytes_read_total as the URL is signed: the control plane never sees them."""
    target = s3_of(checkpoint_storage(), sc.file.name)
    if target is None:
        return None
    metrics.CHECKPOINT_BYTES_READ.inc(sc.size_bytes)
    return presigned_get(target)


def stage_checkpoint_open(sc: StageCheckpoint) -> BinaryIO:
    """A stage checkpoint's file from the checkpoint storage, for the agent that loads it; every byte read from it
    counts in arceus_checkpoint_bytes_read_total (a replica that joins from its peer reads none)."""
    return _CountedReads(checkpoint_storage().open(sc.file.name, "rb"))  # type: ignore[return-value]


class _CountedReads:
    """A storage file whose reads add to arceus_checkpoint_bytes_read_total; anything else is the file's own."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        metrics.CHECKPOINT_BYTES_READ.inc(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


# What the model downloads as: our safetensors file, or a Hugging Face folder (a tar of it).
MODEL_FORMATS = ("safetensors", "hf")


@dataclass(frozen=True)
class ModelFile:
    """The whole model's weights from one checkpoint, as one file served as a stream."""

    checkpoint: Checkpoint
    size_bytes: int
    chunks: Iterator[bytes]  # closes the stage files once consumed (or closed)
    filename: str  # what to save it as


def job_model_file(*, job: Job, model_format: str = "safetensors") -> ModelFile:
    """Every stage's weights (no optimizer state) from the job's newest checkpoint as one safetensors file,
    with the model config and step in its metadata; with `model_format` "hf", as the tar of a Hugging Face folder
    (`config.json` and that file under `transformers`' names, and the job's uploaded `tokenizer.json` if it has
    one) for a model that has that format. Each stage
    file is checked against its hash first, then the file streams from them a chunk at a time: the web
    process never holds the model."""
    if model_format not in MODEL_FORMATS:
        raise ApplicationError.invalid(
            "format", f"must be one of {', '.join(MODEL_FORMATS)}, got {model_format!r}"
        )
    spec = model_spec_from_config(job.model_config)
    if model_format == "hf":
        try:
            hugging_face_format(spec)
        except SpecError as exc:
            raise ApplicationError.invalid(exc.field, exc.message) from exc
    checkpoint = job.checkpoints.order_by("-step").first()
    if checkpoint is None:
        raise ApplicationError.conflict(
            f"job {job.id} has no checkpoint yet; the model is available once training has saved one"
        )
    storage = checkpoint_storage()
    handles = []
    try:
        for sc in checkpoint.stages.order_by("stage_index"):
            handle = storage.open(sc.file.name, "rb")
            handles.append(handle)
            actual = file_digest(handle)
            if actual != sc.sha256:
                raise CheckpointError(f"checkpoint content hash is {actual}, expected {sc.sha256}: corrupt or replaced")
        metadata = {
            "job_id": str(job.id),
            "step": str(checkpoint.step),
            "epoch": str(checkpoint.epoch),
            "model_config": json.dumps(job.model_config, sort_keys=True),
        }
        weights = lambda name: not name.startswith((OPTIMIZER_PREFIX, BUFFER_PREFIX))  # noqa: E731
        if model_format == "hf":
            stage_files, tokenizer = list(handles), _tokenizer_file(job)
            if tokenizer is not None:
                handles.append(tokenizer)  # closed with the stage files
            size, chunks = hugging_face_folder(spec, stage_files, keep=weights, metadata=metadata, tokenizer=tokenizer)
        else:
            size, chunks = merged_checkpoint(handles, keep=weights, metadata=metadata)
    except BaseException:
        for handle in handles:
            handle.close()
        raise

    name = f"{job.id}-step-{checkpoint.step}" + (".tar" if model_format == "hf" else ".safetensors")
    return ModelFile(checkpoint=checkpoint, size_bytes=size, chunks=_closing(chunks, handles), filename=name)


def job_initial_weights_receive(*, job: Job, body: BinaryIO, length: int | None) -> Job:
    """Store the `length` bytes of `body` as the job's initial weights (`job_file_receive`): a Hugging Face
    `model.safetensors` (an exported model: the weights capture() wrote) holding exactly the model's parameters
    (checked from its header), and each layer's digest (`arceus.model.hugging_face`), which the assignments carry
    so agents check the slices they fetch. Only before the job trains (created, failed or cancelled: a start
    trains from them); a later upload replaces an earlier one."""
    spec = model_spec_from_config(job.model_config)
    try:
        initial_weights_names(spec)
    except SpecError as exc:
        raise ApplicationError.invalid(
            "body", f"a model of type {spec.type!r} cannot start from uploaded weights: {exc.message.split(';')[0]}"
        ) from exc

    def check(name: str, reader: HashingReader) -> dict[str, Any]:
        handle, size = storage_open_ranged(checkpoint_storage(), name)
        try:
            with handle:
                hugging_face_weights_check(spec, handle, size)
                layer_digests = initial_weights_layer_digests(spec, handle, size)
        except CheckpointError as exc:
            raise ApplicationError.invalid("body", str(exc)) from exc
        return {"initial_weights_sha256": reader.digest.hexdigest(), "initial_weights_layer_sha256": layer_digests}

    return job_file_receive(
        job=job, body=body, length=length, field="initial_weights",
        name=f"initial-weights/{job.id}/{uuid.uuid4()}.safetensors", what="the weights file", one="a weights file",
        check=check,
    )


@dataclass(frozen=True)
class WeightsSlice:
    """A stage's layers of a job's uploaded initial weights, as one safetensors file served as a stream."""

    size_bytes: int
    chunks: Iterator[bytes]  # closes the stored file once consumed (or closed)


def job_initial_weights_slice_for_node(*, node_id: Any, job_id: str, start: Any, end: Any) -> WeightsSlice:
    """Layers [start, end) of a job's uploaded initial weights under the pipeline's names, for a node that hosts a
    stage holding them: cut from the stored file by range, so neither the web process nor the agent holds more
    than those layers (the agent checks each layer against its digest in the assignment)."""
    job, first, last = hosted_file_layers(
        node_id=node_id, job_id=job_id, field="initial_weights", start=start, end=end, what="initial weights"
    )
    handle, size = storage_open_ranged(checkpoint_storage(), job.initial_weights.name)
    try:
        length, chunks = initial_weights_slice(model_spec_from_config(job.model_config), handle, size, first, last)
    except CheckpointError as exc:  # checked when it was uploaded: the stored file changed since
        handle.close()
        raise ApplicationError.conflict(f"job {job.id}'s stored initial weights are unreadable: {exc}") from exc
    except BaseException:
        handle.close()
        raise
    return WeightsSlice(size_bytes=length, chunks=_closing(chunks, [handle]))


class _LeaseLost(Exception):
    pass


def _tokenizer_file(job: Job) -> BinaryIO | None:
    """The job's uploaded tokenizer.json (`dataset_config.tokenizer_id`) opened, or None: it has none, or its owner
    deleted it once the job ended (the model downloads without it)."""
    tokenizer_id = job.dataset_config.get("tokenizer_id")
    if tokenizer_id is None:
        return None
    try:
        return dataset_open(owner_id=job.owner_id, dataset_id=tokenizer_id)
    except ApplicationError:
        return None


def _closing(chunks: Iterator[bytes], handles: list[Any]) -> Iterator[bytes]:
    """`chunks`, the stored files they are read from closed once consumed (or once the response is closed)."""
    try:
        yield from chunks
    finally:
        for handle in handles:
            handle.close()
