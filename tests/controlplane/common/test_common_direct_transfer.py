"""Direct transfers between an agent and an S3 bucket: what is signed, against moto's S3 server on loopback."""

from __future__ import annotations

from pathlib import Path

import requests
from django.core.files.storage import FileSystemStorage
from django.core.files.storage.handler import StorageHandler

from controlplane.common.direct_transfer import (
    MAX_PARTS,
    PART_BYTES,
    multipart_abort,
    multipart_complete,
    multipart_start,
    presigned_get,
    s3_of,
)
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
    assert (started.part_bytes, len(started.part_urls)) == (PART_BYTES, 1)
    assert requests.put(started.part_urls[0], data=data, timeout=10).ok  # no credentials: the URL is signed
    assert multipart_complete(target, started.upload_id) == len(data)
    assert storage.open("checkpoints/x.safetensors").read() == data  # type: ignore[attr-defined]
    assert requests.get(presigned_get(target), timeout=10).content == data


def test_a_stage_too_large_for_the_part_limit_gets_larger_parts(s3_server: S3Server) -> None:
    target = s3_of(s3_storage(s3_server), "big")
    assert target is not None
    size = PART_BYTES * MAX_PARTS * 2 + 1
    started = multipart_start(target, size)
    assert len(started.part_urls) <= MAX_PARTS and started.part_bytes * len(started.part_urls) >= size
    multipart_abort(target)  # every upload still open for the key
    assert target.client.list_multipart_uploads(Bucket=target.bucket).get("Uploads", []) == []
