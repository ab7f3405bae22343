"""The request-body reader the storages read uploads through."""

from __future__ import annotations

import hashlib
import io

from controlplane.common.uploads import HashingReader


class Trickle(io.RawIOBase):
    """A body that hands over at most 3 bytes a read, as a socket may."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._data.read(min(3, n) if n >= 0 else 3)


def test_a_read_is_short_only_at_the_end_of_the_declared_length() -> None:
    # s3transfer takes a short read for the end of the file: a trickling body must not cut an S3 upload short.
    data = bytes(range(256)) * 4
    reader = HashingReader(Trickle(data + b"beyond"), len(data))
    assert reader.read(1000) == data[:1000]
    assert reader.read(1000) == data[1000:]
    assert reader.read(1000) == b""
    assert reader.received == len(data) and reader.digest.hexdigest() == hashlib.sha256(data).hexdigest()
