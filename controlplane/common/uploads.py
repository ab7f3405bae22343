"""A request body read by a storage as a file: at most its declared length, hashed and counted as it streams."""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Iterable
from typing import BinaryIO

from django.core.files.storage import Storage

from arceus.checkpoint import CHUNK_BYTES


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


def storage_delete(storage: Storage, names: Iterable[str]) -> None:
    """Delete stored files, logging (not raising) a file that cannot be: a leftover file wastes space, while a
    failure here would undo the database change that made it unneeded."""
    for name in names:
        try:
            storage.delete(name)
        except OSError:
            logging.getLogger(__name__).warning("could not delete stored file %s", name, exc_info=True)
