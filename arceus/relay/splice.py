"""A TCP socket spliced onto a relay stream (the agent's Carry, a caller's Dial): bytes in, bytes out, nothing
parsed. Either side ending closes both."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

import grpc

from arceus.v1 import relay_pb2

log = logging.getLogger(__name__)
CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 1024 * 1024  # relays refuse bigger messages


def socket_chunks(sock: socket.socket, *, before: Callable[[], bool] = lambda: True) -> Iterator[relay_pb2.Bytes]:
    """The socket's bytes as stream messages until it ends; nothing when `before()` (called first) is false."""
    if not before():
        return
    while True:
        try:
            data = sock.recv(CHUNK_BYTES)
        except OSError:
            return
        if not data:
            return
        yield relay_pb2.Bytes(data=data)


def write_replies(sock: socket.socket, replies: Iterator[relay_pb2.Bytes]) -> None:
    """Write each reply's bytes to the socket until the stream ends, then close the socket."""
    try:
        for reply in replies:
            sock.sendall(reply.data)
    except grpc.RpcError as exc:
        log.debug("relay stream ended: %s", exc.code())  # the other end went away
    except OSError as exc:
        log.debug("relayed socket closed: %s", exc)
    finally:
        close(sock)


def close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already gone
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
