"""Direct transfers between an agent and an S3 bucket: what is signed, against moto's S3 server on loopback."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import requests
from django.core.files.storage import FileSystemStorage
from django.core.files.storage.handler import StorageHandler

from controlplane.common.direct_transfer import (
    MAX_PARTS,
    MIN_PART_BYTES,
    multipart_abort,
    multipart_complete,
    multipart_start,
    presigned_get,
    s3_of,
)
from controlplane.common.errors import ApplicationError
from controlplane.settings import checkpoint_storage_settings
from tests.controlplane.conftest import S3Server


def s3_storage(s3_server: S3Server, location: str = "") -> object:
    settings = checkpoint_storage_settings(s3_server.env)
    settings["OPTIONS"] = {**settings["OPTIONS"], "location": location}  # type: ignore[dict-item]
    return StorageHandler({"s3": settings})["s3"]


def test_a_filesystem_storage_signs_nothing(tmp_path: Path) -> None:
    assert s3_of(FileSystemStorage(location=str(tmp_path)), "a/b") is None


def test_parts_go_to_the_key_the_storage_keeps_the_file_under_and_come_back_presigned(s3_server: S3Server) -> None:
    storage = s3_storage(s3_server, location="tenant")
    target = s3_of(storage, "checkpoints/x.safetensors")
    assert target is not None and target.key == "tenant/checkpoints/x.safetensors"
    data = bytes(range(256)) * 40
    started = multipart_start(target, len(data))
    assert (started.part_bytes, len(started.part_urls), started.stored) == (64 << 20, 1, [])
    assert requests.put(started.part_urls[0], data=data, timeout=10).ok  # no credentials: the URL is signed
    assert multipart_complete(target, started.upload_id, len(data)) == len(data)
    assert storage.open("checkpoints/x.safetensors").read() == data  # type: ignore[attr-defined]
    assert requests.get(presigned_get(target), timeout=10).content == data


def test_a_stage_too_large_for_the_part_limit_gets_larger_parts(s3_server: S3Server) -> None:
    target = s3_of(s3_storage(s3_server), "big")
    assert target is not None
    size = (64 << 20) * MAX_PARTS * 2 + 1
    started = multipart_start(target, size)
    assert len(started.part_urls) <= MAX_PARTS and started.part_bytes * len(started.part_urls) >= size
    multipart_abort(target)  # every upload still open for the key
    assert target.client.list_multipart_uploads(Bucket=target.bucket).get("Uploads", []) == []


def test_a_start_for_an_upload_left_open_resumes_it_with_the_parts_the_storage_holds(
    s3_server: S3Server, settings
) -> None:  # noqa: ANN001
    settings.ARCEUS_CHECKPOINT_PART_BYTES = MIN_PART_BYTES
    target = s3_of(s3_storage(s3_server), "checkpoints/resumed.safetensors")
    assert target is not None
    data = bytes(range(256)) * (MIN_PART_BYTES // 256 * 2 + 100)  # two whole parts and a short one
    parts = [data[i : i + MIN_PART_BYTES] for i in range(0, len(data), MIN_PART_BYTES)]
    older = multipart_start(target, len(data))  # an uploader that died before it sent anything
    target.client.create_multipart_upload(Bucket=target.bucket, Key=target.key)  # and one that sent part 1
    first = multipart_start(target, len(data))
    assert first.upload_id != older.upload_id and first.stored == [] and len(first.part_urls) == 3
    assert requests.put(first.part_urls[0], data=parts[0], timeout=10).ok
    with pytest.raises(ApplicationError, match="lacks parts 2, 3 of 3"):
        multipart_complete(target, first.upload_id, len(data))

    again = multipart_start(target, len(data))  # the uploader comes back: the same upload, part 1 stored
    assert again.upload_id == first.upload_id and again.resumed
    assert [(p.number, p.size_bytes, p.etag.strip('"')) for p in again.stored] == [
        (1, MIN_PART_BYTES, hashlib.md5(parts[0]).hexdigest())
    ]
    ids = [u["UploadId"] for u in target.client.list_multipart_uploads(Bucket=target.bucket)["Uploads"]]
    assert ids == [first.upload_id]  # the older one was aborted
    for url, part in zip(again.part_urls[1:], parts[1:], strict=True):
        assert requests.put(url, data=part, timeout=10).ok
    assert multipart_complete(target, again.upload_id, len(data)) == len(data)
    assert requests.get(presigned_get(target), timeout=10).content == data
