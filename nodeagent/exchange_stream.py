"""The wire of the replicas' exact exchange (nodeagent.replicas): one peer stream (nodeagent.peer_streams) per pair
of siblings, opened once per membership epoch, whose frames are read straight into the exchange's preallocated
vectors.

Opening: the lower replica id asks the higher one `ReplicaService.ExchangePort` (answered once a RunStep of the
epoch reached it, so it trusts the dialer's certificate) and dials its agent's stream listener (at the sibling's
`ReplicaPeer.exchange_address`, the address its agent registered, else at that port on the host of its address; a
relayed sibling's through its relay), pinned both ways, and the exchange adopting a stream checks it is exactly the
sibling's. The dialer's hello names job, stage, generation, both replicas, the epoch and the dialer's replica token;
the listener hands a stream only to the hosted replica it names.

Frames: a fixed header (step, epoch, phase, start element, element count, signature length) checked against the
one frame the exchange expects next from that sibling before a byte of payload is read, so a sibling cannot make
this agent allocate, and a frame of another step or epoch is refused."""

from __future__ import annotations

import hashlib
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from nodeagent.peer_streams import FrameStream, HelloKind, StreamFailure

REDUCE, GATHER = 1, 2  # a member's partial of a chunk to its owner; the owner's sum back to every member
PHASES = {REDUCE: "REDUCE", GATHER: "GATHER"}
MAX_SIGNATURE_BYTES = 128  # an audited step's Ed25519 signature of a REDUCE frame (arceus.verify.receipts): 64
_MAGIC_HELLO, _MAGIC_FRAME = b"AXH1", b"AXF1"
_MAX_ID = 64
# magic, job id (UTF-8, NUL-padded), stage, generation, target replica, source replica, epoch, source's replica token
HELLO = struct.Struct(f"!4s{_MAX_ID}sqqiiq{_MAX_ID}s")
# magic, step, epoch, phase, start element, element count, signature bytes
FRAME = struct.Struct("!4sqqBqqH")


@dataclass(frozen=True)
class Hello:
    job_id: str
    stage_index: int
    generation: int
    target: int
    source: int
    epoch: int
    token: str = ""  # sent by the dialer; the listener keeps only its digest
    token_digest: str = ""

    def pack(self) -> bytes:
        job, token = self.job_id.encode(), self.token.encode()
        if not 0 < len(job) <= _MAX_ID or not 0 < len(token) <= _MAX_ID:
            raise ValueError(f"a hello names a job id and a replica token of 1 to {_MAX_ID} bytes")
        return HELLO.pack(_MAGIC_HELLO, job, self.stage_index, self.generation, self.target, self.source, self.epoch,
                          token)

    @classmethod
    def unpack(cls, data: bytes | bytearray) -> Hello:
        magic, job, stage, generation, target, source, epoch, token = HELLO.unpack(data)
        if magic != _MAGIC_HELLO:
            raise ValueError("not an exchange stream's hello")
        return cls(job.rstrip(b"\0").decode(errors="replace"), stage, generation, target, source, epoch,
                   token_digest=hashlib.sha256(token.rstrip(b"\0")).hexdigest())


def exchange_hellos(adopt: Callable[[Hello, ssl.SSLSocket], None]) -> dict[bytes, HelloKind]:
    """The listener's kind for siblings' exchange streams: each handed to `adopt` (the hosted replica its hello
    names parks it for its exchange, or refuses it: RpcFailure)."""
    return {_MAGIC_HELLO: HelloKind(HELLO.size, lambda data, sock: adopt(Hello.unpack(data), sock))}


@dataclass
class Expected:
    """A frame the exchange waits for: its header's fields, where its payload goes (`into`, exactly its bytes), and
    what is done once it is in (given the frame's signature)."""

    step: int
    epoch: int
    phase: int
    start: int
    length: int
    into: memoryview
    on_done: Callable[[bytes], None]
    _signature: bytearray | None = None

    @property
    def what(self) -> str:
        return f"its {PHASES[self.phase]} shard at element {self.start} of step {self.step}"

    def accept(self, header: bytes, sender: str) -> Sequence[memoryview]:
        """The signature's bytes and the payload's, once the header just read is exactly this frame's."""
        magic, step, epoch, phase, start, length, signature = FRAME.unpack(header)
        got = (magic, step, epoch, phase, start, length)
        wanted = (_MAGIC_FRAME, self.step, self.epoch, self.phase, self.start, self.length)
        if got != wanted:
            raise StreamFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{sender} sent a frame of step {step} epoch {epoch} phase {phase} at element "
                f"{start} of {length} elements where its {PHASES[self.phase]} shard of step {self.step} epoch "
                f"{self.epoch} at element {self.start} of {self.length} elements was due",
            )
        if signature > (MAX_SIGNATURE_BYTES if phase == REDUCE else 0):
            raise StreamFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{sender}'s {PHASES[phase]} shard carries a signature of {signature} bytes",
            )
        self._signature = bytearray(signature)
        return memoryview(self._signature), self.into

    def done(self) -> None:
        self.on_done(bytes(self._signature or b""))


class Stream(FrameStream):
    """The exchange's end of one sibling's stream."""

    def __init__(self, sock: ssl.SSLSocket, peer: int, name: str) -> None:
        super().__init__(sock, FRAME.size, f"replica {peer}", name)

    def send_shard(self, step: int, epoch: int, phase: int, start: int, payload: memoryview,
                   signature: bytes = b"") -> None:
        """Queue a frame (`payload`: bytes of float32 values, left untouched until it is sent)."""
        self.send(FRAME.pack(_MAGIC_FRAME, step, epoch, phase, start, len(payload) // 4, len(signature)) + signature,
                  payload)
