"""Files that move between an agent and an S3-compatible storage directly: the control plane signs each
request (presigned URLs, valid for TRANSFER_SECONDS, each for one object and one operation), it never carries
the bytes. A multipart upload is started, completed and aborted by the control plane; the agent PUTs its parts
to their presigned URLs (a failed part is sent again to the same URL). A start for an object whose upload is
already open resumes it: it answers the parts the storage holds (ListParts), and the agent sends only the others.
With any other storage (the filesystem) nothing is signed: `s3_of` is None and callers keep streaming through the
control plane.

The URLs name the storage's endpoint (AWS_S3_ENDPOINT_URL): agents must reach it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError
from django.conf import settings
from django.core.files.storage import Storage

from controlplane.common.errors import ApplicationError

# How long a presigned URL works: one stage's upload or download, at a slow node's bandwidth.
TRANSFER_SECONDS = 6 * 3600
# How long a presigned ranged read works: one step's samples, fetched at once.
RANGE_SECONDS = 300
# Parts of a multipart upload: S3 takes at most 10,000, each but the last at least 5 MiB (the part size is
# settings.ARCEUS_CHECKPOINT_PART_BYTES, 64 MiB unless set: it bounds the uploader's buffer, one part, and keeps a
# 16 GB stage at 256 requests).
MIN_PART_BYTES = 5 << 20
MAX_PARTS = 10_000


@dataclass(frozen=True)
class S3Object:
    client: Any  # boto3's S3 client, with the storage's endpoint and credentials
    bucket: str
    key: str


@dataclass(frozen=True)
class StoredPart:
    number: int  # from 1
    size_bytes: int
    etag: str  # as the storage answers it: the MD5 of the part's bytes in hex, quoted, on S3 without SSE-KMS


@dataclass(frozen=True)
class MultipartUpload:
    upload_id: str
    part_bytes: int  # every part's size but the last's
    part_urls: list[str]  # PUT part i+1's bytes to part_urls[i]
    stored: list[StoredPart]  # what the storage already holds of a resumed upload (none of a new one)

    @property
    def resumed(self) -> bool:
        return bool(self.stored)


def s3_of(storage: Storage, name: str) -> S3Object | None:
    """The S3 object a storage keeps `name` in, or None for a storage that is no S3 bucket (django-storages'
    S3Storage is recognised by its boto3 connection, so a deployment without django-storages still loads)."""
    connection = getattr(storage, "connection", None)
    bucket = getattr(storage, "bucket_name", None)
    if connection is None or not bucket:
        return None
    location = getattr(storage, "location", "").strip("/")
    return S3Object(connection.meta.client, bucket, f"{location}/{name}" if location else name)


def part_size(size_bytes: int) -> int:
    """Every part's size but the last's, for an upload of `size_bytes` bytes."""
    return max(settings.ARCEUS_CHECKPOINT_PART_BYTES, math.ceil(size_bytes / MAX_PARTS))


def multipart_start(target: S3Object, size_bytes: int) -> MultipartUpload:
    """A multipart upload of `size_bytes` bytes into `target`, with a presigned URL for each part. An upload still
    open for `target` (its uploader was interrupted) is resumed, its parts as the storage lists them; any older one
    open beside it is aborted."""
    part_bytes = part_size(size_bytes)
    parts = max(1, math.ceil(size_bytes / part_bytes))
    open_uploads = _open_uploads(target)
    if open_uploads:
        upload_id = open_uploads[-1]
        for older in open_uploads[:-1]:
            _s3(lambda o=older: target.client.abort_multipart_upload(Bucket=target.bucket, Key=target.key, UploadId=o))
        stored = [p for p in multipart_parts(target, upload_id) if p.number <= parts]
    else:
        created = _s3(lambda: target.client.create_multipart_upload(Bucket=target.bucket, Key=target.key))
        upload_id, stored = created["UploadId"], []
    urls = [
        target.client.generate_presigned_url(
            "upload_part",
            Params={"Bucket": target.bucket, "Key": target.key, "UploadId": upload_id, "PartNumber": number},
            ExpiresIn=TRANSFER_SECONDS,
        )
        for number in range(1, parts + 1)
    ]
    return MultipartUpload(upload_id, part_bytes, urls, stored)


def multipart_parts(target: S3Object, upload_id: str) -> list[StoredPart]:
    """The parts the storage holds of the multipart upload `upload_id` of `target`, by number (ListParts)."""

    def listed() -> list[StoredPart]:
        pages = target.client.get_paginator("list_parts").paginate(
            Bucket=target.bucket, Key=target.key, UploadId=upload_id
        )
        return [StoredPart(p["PartNumber"], p["Size"], p["ETag"]) for page in pages for p in page.get("Parts", [])]

    return sorted(_s3(listed), key=lambda p: p.number)


def multipart_complete(target: S3Object, upload_id: str, size_bytes: int) -> int:
    """Complete the multipart upload `upload_id` of `target`, a file of `size_bytes` bytes, from exactly its parts
    1..n (`part_size`) as the storage lists them (never taken from the uploader's word); a 409 naming the parts
    missing while any is. The object's size as the storage answers it. An id of another object's upload is refused
    here (not every S3-compatible server binds an upload id to its key)."""
    if upload_id not in _open_uploads(target):
        raise ApplicationError.conflict(f"no multipart upload {upload_id} is open for this file")
    count = max(1, math.ceil(size_bytes / part_size(size_bytes)))
    listed = {p.number: p for p in multipart_parts(target, upload_id) if p.number <= count}
    missing = [n for n in range(1, count + 1) if n not in listed]
    if missing:
        raise ApplicationError.conflict(
            f"multipart upload {upload_id} lacks parts {', '.join(map(str, missing[:20]))} of {count}: send them first"
        )
    parts = [{"PartNumber": p.number, "ETag": p.etag} for p in listed.values()]
    _s3(lambda: target.client.complete_multipart_upload(
        Bucket=target.bucket, Key=target.key, UploadId=upload_id, MultipartUpload={"Parts": parts}
    ))
    return int(_s3(lambda: target.client.head_object(Bucket=target.bucket, Key=target.key))["ContentLength"])


def multipart_abort(target: S3Object, upload_id: str | None = None) -> None:
    """Abort the multipart upload `upload_id` of `target`, or (None) every one still open for it, so no parts
    are left stored (and billed) unseen."""
    ids = _open_uploads(target)
    for each in ids if upload_id is None else [upload_id] if upload_id in ids else []:
        _s3(lambda each=each: target.client.abort_multipart_upload(Bucket=target.bucket, Key=target.key, UploadId=each))


def _open_uploads(target: S3Object) -> list[str]:
    """The ids of the multipart uploads open for `target`'s key, oldest first."""
    listed = _s3(lambda: target.client.list_multipart_uploads(Bucket=target.bucket, Prefix=target.key))
    uploads = sorted((u for u in listed.get("Uploads", []) if u["Key"] == target.key), key=lambda u: u["Initiated"])
    return [u["UploadId"] for u in uploads]


def presigned_get(target: S3Object) -> str:
    """A URL that GETs `target`'s bytes straight from the storage."""
    return target.client.generate_presigned_url(
        "get_object", Params={"Bucket": target.bucket, "Key": target.key}, ExpiresIn=TRANSFER_SECONDS
    )


def presigned_ranged_get(target: S3Object, start: int, stop: int) -> str:
    """A URL that GETs bytes [start, stop) of `target` straight from the storage, valid for RANGE_SECONDS: its Range
    header is signed (SigV4, the storage's signature version: controlplane.settings), so the URL reads nothing else."""
    return target.client.generate_presigned_url(
        "get_object", Params={"Bucket": target.bucket, "Key": target.key, "Range": f"bytes={start}-{stop - 1}"},
        ExpiresIn=RANGE_SECONDS,
    )


def _s3(call: Any) -> Any:
    """`call()`, an S3 request; the storage's refusal of it (no such upload, a part too small) as a 409."""
    try:
        return call()
    except ClientError as exc:
        error = exc.response.get("Error", {})
        raise ApplicationError.conflict(
            f"the checkpoint storage refused it: {error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")
        ) from exc
