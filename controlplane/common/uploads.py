"""A request body read by a storage as a file: at most its declared length, hashed and counted as it streams; a
stored file read by range; stored files deleted."""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Iterable
from typing import Any, BinaryIO

from django.core.files.storage import Storage

from arceus.safetensors_file import CHUNK_BYTES


class HashingReader(io.RawIOBase):
    """At most `length` bytes of a request body, hashed and counted as the storage reads them (a readable,
    unseekable file to the storage). A read returns all it asks for unless the body ends: S3 uploads
    (s3transfer) take a short read for the end of the file."""

    def __init__(self, body: BinaryIO, length: int) -> None:
        super().__init__()
        self._body = body
        self._left = length
        self.received = 0
        self.digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        n = min(CHUNK_BYTES, self._left) if n is None or n < 0 else min(n, self._left)
        pieces = []
        while n > 0 and (data := self._body.read(min(n, CHUNK_BYTES))):
            pieces.append(data)
            n -= len(data)
        data = b"".join(pieces)
        self._left -= len(data)
        self.received += len(data)
        self.digest.update(data)
        return data

    def readable(self) -> bool:
        return True


def storage_open_ranged(storage: Storage, name: str) -> tuple[BinaryIO, int]:
    """A stored file open for reading by range (seek, read) and its size. A filesystem's file is that already;
    an S3 object (django-storages' S3File, which downloads the whole object at its first read) is read through
    one ranged GET per read instead, so a reader of a few tensors of a large file fetches only their bytes."""
    handle = storage.open(name, "rb")
    stored = getattr(handle, "obj", None)  # S3File's boto3 Object, loaded (its size known), not yet downloaded
    if stored is None:
        return handle, storage.size(name)
    handle.close()
    return _RangedObject(stored), stored.content_length


class _RangedObject(io.RawIOBase):
    """A boto3 S3 Object as a seekable read-only file: each read is one GET of the bytes it asks for."""

    def __init__(self, stored: Any) -> None:
        super().__init__()
        self._object, self._size, self._position = stored, stored.content_length, 0

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._size - self._position)
        if n <= 0:
            return 0
        body = self._object.get(Range=f"bytes={self._position}-{self._position + n - 1}")["Body"]
        data = body.read()
        body.close()
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def storage_delete(storage: Storage, names: Iterable[str]) -> None:
    """Delete stored files, logging (not raising) a file that cannot be: a leftover file wastes space, while a
    failure here would undo the database change that made it unneeded."""
    for name in names:
        try:
            storage.delete(name)
        except OSError:
            logging.getLogger(__name__).warning("could not delete stored file %s", name, exc_info=True)
