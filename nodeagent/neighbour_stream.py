"""The activations and gradients between two adjacent stages that are one agent each, on one peer stream per pair
(nodeagent.peer_streams) instead of gRPC's PushStream: written and read by the step's own thread, so a tensor wakes
no other thread in either process (docs/BENCHMARKS.md, "MLP pipeline vs one process").

Which links: one between two stages neither of which is replicated nor split tensor-parallel, of a job with
staleness 0, whose agents both declared they speak it (`streamed_links`, from the assignment alone, so both ends
agree; an agent of an older version declares nothing, and its links keep PushStream). Every other tensor keeps
PushStream: a replica's routed ones, a tensor-parallel stage's ranks, a stale job's, tied weights' gradients, the
driver's.

Opening: the previous stage asks the next one `StageService.NeighbourStreamPort` over its gRPC link (authenticated
as its pushes are: its bearer token, role PREV) and dials that agent's stream listener, pinned to the certificate
its assignment names for the next stage's address; the next stage's agent trusts only the certificate its own
assignment names for its previous stage. The hello names job, stage, generation and the dialer's stage index, and
carries the dialer's stage token: the listener hands the stream to the stage it names only where that token's
digest has role PREV there and the stream's certificate is that one (`NeighbourStreams.offer`).

Frames: each way, a step's frames on a link are known before the step starts, from the schedule both ends run
(`link_frames`): the previous stage's activations (its forwards, in order), the next stage's gradients (its
backwards), and one ACK each way once the last of the other's frames was taken (one ack a link a step, as
PushStream's ack_later). A frame's fixed header (step, micro-batch, kind, dtype, shape, encoding, payload sizes) is
checked against the frame due and against the stage's layout and bounds (nodeagent.validation) before its payload
is allocated; the payload is read into buffers of exactly its size and decoded as a push is (compressed or not; fp32
without a copy). A broken stream or a frame other than the one due fails the step, and the stage closes both its
streams, so its neighbours' steps fail at once too; the next step opens them anew."""

from __future__ import annotations

import hashlib
import hmac
import math
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from arceus.contracts.assignment import Assignment
from arceus.contracts.credentials import Role
from arceus.contracts.data_plane import link_streamed
from arceus.pipeline.schedule import Action
from arceus.v1 import stage_pb2, stage_pb2_grpc
from arceus.wire import codec
from arceus.wire.compression import ENCODINGS, Encoded, check_block_size
from nodeagent.peer_streams import FrameStream, HelloKind, Offers, PeerStreams, StreamFailure, pump_all
from nodeagent.rpc import RpcFailure, neighbour_failure_code
from nodeagent.stage_io import StageIO
from nodeagent.validation import check_layout, decode_checked, expected_layout

ACTIVATION, GRADIENT, ACK = stage_pb2.ACTIVATION, stage_pb2.GRADIENT, 0x7F
KIND_WORDS = {ACTIVATION: "ACTIVATION", GRADIENT: "GRADIENT", ACK: "ACK"}
_MAGIC_HELLO, _MAGIC_FRAME = b"ANH1", b"ANF1"
_MAX_ID = 64
_DIMS = codec.MAX_RANK
# magic, job id (UTF-8, NUL-padded), target stage, generation, source stage, the source's stage token
HELLO = struct.Struct(f"!4s{_MAX_ID}sqqq{_MAX_ID}s")
# magic, step, micro-batch, kind, dtype (ASCII, NUL-padded), encoding (index in ENCODINGS), int8 block size, rank,
# dims, data bytes, scales bytes, indices bytes
FRAME = struct.Struct(f"!4sqiB16sBIB{_DIMS}qQQQ")
FrameKey = tuple[int, int]  # (kind, micro-batch)


@dataclass(frozen=True)
class NeighbourHello:
    job_id: str
    target: int  # the stage dialled
    generation: int
    source: int  # the dialer's stage
    token: str = ""  # sent by the dialer; the listener keeps only its digest
    token_digest: str = ""

    def pack(self) -> bytes:
        job, token = self.job_id.encode(), self.token.encode()
        if not 0 < len(job) <= _MAX_ID or not 0 < len(token) <= _MAX_ID:
            raise ValueError(f"a hello names a job id and a stage token of 1 to {_MAX_ID} bytes")
        return HELLO.pack(_MAGIC_HELLO, job, self.target, self.generation, self.source, token)

    @classmethod
    def unpack(cls, data: bytes) -> NeighbourHello:
        magic, job, target, generation, source, token = HELLO.unpack(data)
        if magic != _MAGIC_HELLO:
            raise ValueError("not a neighbour stream's hello")
        return cls(job.rstrip(b"\0").decode(errors="replace"), target, generation, source,
                   token_digest=hashlib.sha256(token.rstrip(b"\0")).hexdigest())


def neighbour_hellos(adopt: Callable[[NeighbourHello, ssl.SSLSocket], None]) -> dict[bytes, HelloKind]:
    """The listener's kind for neighbour streams: each handed to `adopt` (the registry's: the stage its hello names
    takes it, or refuses it: RpcFailure)."""
    return {_MAGIC_HELLO: HelloKind(HELLO.size, lambda data, sock: adopt(NeighbourHello.unpack(data), sock))}


def streamed_links(a: Assignment) -> tuple[bool, bool]:
    """Whether the links to the previous and to the next stage run over a neighbour stream: both stages one agent
    (not replicated, not tensor-parallel), of a job with staleness 0 (with staleness 1 two steps run at once on a
    stage, and their frames would share a stream in no order both ends know), and both agents declared they speak
    it (arceus.contracts.data_plane.link_streamed). Decided from the assignment alone, which names the neighbours'
    ranks and features, so both ends agree."""
    alone = a.replica is None and a.tensor_parallel is None and not a.inference and a.staleness == 0
    own = a.data_plane.own
    return (alone and a.prev_address is not None and not a.prev_ranks and link_streamed(a.data_plane.prev, own),
            alone and a.next_address is not None and not a.next_ranks and link_streamed(own, a.data_plane.next))


def link_frames(lower: Sequence[Action], upper: Sequence[Action]) -> tuple[list[FrameKey], list[FrameKey]]:
    """A step's frames on the link between a stage (`lower`: its actions) and the next one (`upper`: its actions),
    each way in the order they are written: down, the lower's activations (its forwards), and its ACK once it took
    the upper's last gradient; up, the upper's gradients (its backwards), and its ACK once it took the lower's last
    activation. An action takes its input before it computes and sends."""
    return _frames(lower, sends="F", takes="B", kind=ACTIVATION), _frames(upper, sends="B", takes="F", kind=GRADIENT)


def _frames(actions: Sequence[Action], *, sends: str, takes: str, kind: int) -> list[FrameKey]:
    last_taken = max((i for i, a in enumerate(actions) if a.kind == takes), default=None)
    frames: list[FrameKey] = []
    for i, action in enumerate(actions):
        if i == last_taken:
            frames.append((ACK, 0))
        if action.kind == sends:
            frames.append((kind, action.micro_batch))
    return frames


def frame_header(step: int, micro_batch: int, kind: int, encoded: Encoded | None = None) -> bytes:
    """A frame's header: a tensor's (`encoded`, float32 as every activation and gradient is), or an ACK's."""
    if encoded is None:
        return FRAME.pack(_MAGIC_FRAME, step, micro_batch, kind, b"", 0, 0, 0, *([0] * _DIMS), 0, 0, 0)
    shape = list(encoded.shape)
    return FRAME.pack(
        _MAGIC_FRAME, step, micro_batch, kind, b"float32", ENCODINGS.index(encoded.encoding), encoded.block_size,
        len(shape), *shape, *([0] * (_DIMS - len(shape))), len(encoded.data), len(encoded.scales),
        len(encoded.indices),
    )


def payload_sizes(tensor: stage_pb2.Tensor, data: int, scales: int, indices: int) -> None:
    """Check the payload sizes a header claims for `tensor` (its dtype, shape, encoding and block size, already
    checked against the stage's layout) before a byte of them is allocated: exactly what its encoding takes
    (top-k: at most one value and index per element). codec.TensorValidationError naming the first wrong."""
    numel = math.prod(tensor.shape)
    encoding = tensor.encoding or "fp32"
    want_scales = want_indices = 0
    if encoding in ("fp32", "fp16", "bf16"):
        want_data = numel * (codec.itemsize(tensor.dtype) if encoding == "fp32" else 2)
        if tensor.block_size:
            raise codec.TensorValidationError(f"{encoding} payloads carry no block_size")
    elif encoding == "int8":
        want_data, want_scales = numel, -(-numel // check_block_size(tensor.block_size)) * 4
    else:  # topk
        if data != indices or data % 4 or data > numel * 4:
            raise codec.TensorValidationError(
                f"topk payloads hold one float32 value and one int32 index per kept element, at most {numel}; got "
                f"{data} bytes of values and {indices} of indices"
            )
        want_data, want_indices = data, indices
    for what, got, want in (("data", data, want_data), ("scales", scales, want_scales),
                            ("indices", indices, want_indices)):
        if got != want:
            raise codec.TensorValidationError(f"{encoding} {what} of shape {list(tensor.shape)} must be {want:,} "
                                              f"bytes, got {got:,}")


class _Due:
    """A frame a step waits for on a link: checked header first, then its payload into buffers of exactly its size,
    then decoded into the step's inbox."""

    def __init__(self, wire: StepWire, link: _Link, step: int, key: FrameKey) -> None:
        self._wire, self._link, self._step, self.key = wire, link, step, key
        self._tensor: stage_pb2.Tensor | None = None
        self._buffers: tuple[bytearray, bytearray, bytearray] | None = None
        self._max_bytes = 0

    @property
    def what(self) -> str:
        kind, m = self.key
        return f"the ACK of step {self._step}" if kind == ACK else \
            f"the {KIND_WORDS[kind]} of step {self._step} micro-batch {m}"

    def accept(self, header: bytes, sender: str) -> Sequence[memoryview]:
        magic, step, m, kind, dtype, encoding, block_size, rank, *rest = FRAME.unpack(header)
        dims, (data, scales, indices) = rest[:_DIMS], rest[_DIMS:]
        if (magic, step, kind, m) != (_MAGIC_FRAME, self._step, *self.key):
            raise StreamFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{sender} sent a frame of step {step} kind {KIND_WORDS.get(kind, kind)} micro-batch {m} where "
                f"{self.what} was due",
            )
        if kind == ACK:
            if any((dtype.strip(b"\0"), encoding, block_size, rank, *dims, data, scales, indices)):
                raise StreamFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{sender}'s ACK carries a payload")
            return ()
        if rank > _DIMS or encoding >= len(ENCODINGS) or any(dims[rank:]):
            raise StreamFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{sender}'s header of {self.what} is malformed (rank {rank}, encoding {encoding})")
        tensor = stage_pb2.Tensor(dtype=dtype.rstrip(b"\0").decode("ascii", errors="replace"), shape=dims[:rank],
                                  block_size=block_size)
        if ENCODINGS[encoding] != "fp32":
            tensor.encoding = ENCODINGS[encoding]
        io = self._wire.io
        try:
            self._max_bytes = check_layout(KIND_WORDS[kind], tensor, expected_layout(io, kind),
                                           io.max_micro_batch_size)
            payload_sizes(tensor, data, scales, indices)
        except codec.TensorValidationError as exc:
            raise StreamFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{sender} sent {self.what}, refused: {exc}") from None
        except RpcFailure as exc:
            raise StreamFailure(exc.code, f"{sender} sent {self.what}, refused: {exc.message}") from None
        self._tensor = tensor
        self._buffers = (bytearray(data), bytearray(scales), bytearray(indices))
        return tuple(memoryview(b) for b in self._buffers)

    def done(self) -> None:
        if self.key[0] == ACK:  # what this step sent on the link was taken there
            self._wire.add_bytes_sent(self._link.bytes_sent)
            self._link.bytes_sent = 0
            return
        assert self._tensor is not None and self._buffers is not None
        data, scales, indices = self._buffers
        kind = self.key[0]
        tensor = decode_checked(self._wire.io, kind, self._tensor, data, scales, indices, self._max_bytes)
        self._wire.arrived_frame(self.key, tensor, len(data) + len(scales) + len(indices))


class _Link:
    """One side of the step on one link: its stream and what this step sends and reads on it."""

    def __init__(self, name: str, sends: list[FrameKey], takes: list[FrameKey]) -> None:
        self.name = name  # "prev" or "next"
        self.sends, self.takes = sends, takes
        self.stream: FrameStream | None = None
        self.taken = 0  # data frames of `takes` the step took
        self.data_frames = sum(1 for kind, _ in takes if kind != ACK)
        self.bytes_sent = 0


class StepWire:
    """One step's traffic on the stage's neighbour streams, moved only by the step's thread."""

    def __init__(self, owner: NeighbourStreams, step: int, schedule: Sequence[Sequence[Action]], deadline: float,
                 abort: threading.Event) -> None:
        self._owner, self.step, self.io = owner, step, owner.io
        self._deadline, self._abort = deadline, abort
        index = self.io.stage_index
        self._links: dict[str, _Link] = {}
        if owner.prev_streamed:
            down, up = link_frames(schedule[index - 1], schedule[index])
            self._links["prev"] = _Link("prev", sends=up, takes=down)
        if owner.next_streamed:
            down, up = link_frames(schedule[index], schedule[index + 1])
            self._links["next"] = _Link("next", sends=down, takes=up)
        self._inbox: dict[FrameKey, torch.Tensor] = {}
        self.bytes_received = 0  # tensor bytes read off the streams, as they travelled

    def carries(self, kind: int, incoming: bool) -> bool:
        """Whether this step's tensors of `kind` coming in (else going out) travel on a neighbour stream."""
        return self._link_of(kind, incoming) is not None

    def _link_of(self, kind: int, incoming: bool) -> _Link | None:
        if kind not in (ACTIVATION, GRADIENT):  # tied gradients go to stages that need not be neighbours: PushStream
            return None
        from_prev = (kind == ACTIVATION) == incoming
        return self._links.get("prev" if from_prev else "next")

    def arrived(self) -> list[FrameKey]:
        return list(self._inbox)

    def receive(self, kind: int, micro_batch: int) -> torch.Tensor:
        """The tensor of `kind` for `micro_batch`, read off its link (waiting for it); the link's ACK goes back once
        the step took the last of its tensors."""
        link = self._link_of(kind, incoming=True)
        assert link is not None
        self._open(link)
        key = (kind, micro_batch)
        self._pump_until(lambda: key in self._inbox, lambda: f"the {KIND_WORDS[kind]} of step {self.step} "
                         f"micro-batch {micro_batch} from stage {self._peer_index(link)}")
        tensor = self._inbox.pop(key)
        link.taken += 1
        if link.taken == link.data_frames:
            self._write(link, frame_header(self.step, 0, ACK))
        return tensor

    def send(self, kind: int, micro_batch: int, encoded: Encoded) -> None:
        """Queue the tensor (as encoded) on its link, and write what the socket takes now."""
        link = self._link_of(kind, incoming=False)
        assert link is not None
        self._open(link)
        # Counted before it is written: the neighbour's ACK may be read while this frame is written.
        link.bytes_sent += encoded.nbytes
        self._write(link, frame_header(self.step, micro_batch, kind, encoded), encoded.data, encoded.scales,
                    encoded.indices)

    def finish(self) -> None:
        """Wait until every frame of the step went out and every frame due came in (the neighbours' ACKs
        included)."""
        for link in self._links.values():
            if link.sends or link.takes:
                self._open(link)
        streams = self._streams()
        self._pump_until(lambda: all(s.idle for s in streams), self._waiting_for)

    def add_bytes_sent(self, nbytes: int) -> None:
        self._owner.add_bytes_sent(nbytes)

    def arrived_frame(self, key: FrameKey, tensor: torch.Tensor, nbytes: int) -> None:
        self._inbox[key] = tensor
        self.bytes_received += nbytes
        self._owner.add_bytes_received(nbytes)

    def fail(self) -> None:
        """The step failed: the stage's streams close (its neighbours' steps fail at once; the next step opens them
        anew)."""
        self._owner.close_streams()

    def _write(self, link: _Link, *pieces: bytes | memoryview) -> None:
        assert link.stream is not None
        link.stream.send(*pieces)
        for stream in self._streams():
            stream.pump()

    def _open(self, link: _Link) -> None:
        if link.stream is not None:
            return
        link.stream = self._owner.stream(link.name, self._deadline, self._abort)
        for key in link.takes:
            link.stream.expect(_Due(self, link, self.step, key))

    def _streams(self) -> list[FrameStream]:
        return [link.stream for link in self._links.values() if link.stream is not None]

    def _pump_until(self, done: Callable[[], bool], waiting_for: Callable[[], str]) -> None:
        pump_all(self._streams(), deadline=self._deadline, abort=self._abort, done=done,
                 waiting_for=lambda: f"{self._owner.name} waited for {waiting_for()} until its deadline")

    def _peer_index(self, link: _Link) -> int:
        return self.io.stage_index + (-1 if link.name == "prev" else 1)

    def _waiting_for(self) -> str:
        for link in self._links.values():
            if link.stream is None:
                continue
            due = link.stream.next_expected()
            if due is not None:
                return f"{due.what} from stage {self._peer_index(link)}"
            if link.stream.sending:
                return f"stage {self._peer_index(link)} to take this stage's frames"
        return "nothing"


class NeighbourStreams:
    """A stage's neighbour streams, kept from step to step: the one it dials to the next stage, the one the previous
    stage dialled to it (`offer`)."""

    def __init__(self, assignment: Assignment, io: StageIO, name: str, peer_streams: PeerStreams | None,
                 next_channel: grpc.Channel | None, counted: tuple[Callable[[int], None], Callable[[int], None]]
                 ) -> None:
        """`io`: the stage's StageIO; `next_channel`: the gRPC channel to the next stage (asked where its listener
        is); `counted`: (add bytes sent, add bytes received) of the stage's counters."""
        self._assignment, self.io, self.name = assignment, io, name
        self.prev_streamed, self.next_streamed = streamed_links(assignment)
        self._peer_streams = peer_streams
        self._next_stub = None if next_channel is None else stage_pb2_grpc.StageServiceStub(next_channel)
        self.add_bytes_sent, self.add_bytes_received = counted
        self._streams: dict[str, FrameStream] = {}
        self._offers: Offers[int, None] = Offers(name)  # the previous stage's newest stream, until a step takes it
        if self.prev_streamed and peer_streams is not None:
            peer_streams.trust([assignment.certificates[assignment.prev_address]])

    @property
    def any(self) -> bool:
        return self.prev_streamed or self.next_streamed

    def offer(self, hello: NeighbourHello, sock: ssl.SSLSocket) -> None:
        """A stream the previous stage opened (the listener's thread): kept for the next step that reads from it, or
        refused (RpcFailure; the listener closes it)."""
        a = self._assignment
        if not self.prev_streamed or hello.source != a.stage_index - 1:
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"{self.name} takes no neighbour stream from stage {hello.source}")
        if not any(hmac.compare_digest(hello.token_digest, d) for d in a.credentials.accepts.get(Role.PREV, ())):
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"{self.name}: a neighbour stream presented no token of its previous stage")
        certificate = ssl.PEM_cert_to_DER_cert(a.certificates[a.prev_address])
        if sock.getpeercert(binary_form=True) != certificate:
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"{self.name}: a neighbour stream came from another agent than its previous stage's")
        self._offers.put(hello.source, None, sock)

    def begin(self, step: int, schedule: Sequence[Sequence[Action]], deadline: float,
              abort: threading.Event) -> StepWire:
        """The wire of step `step`, whose every stage's actions are `schedule`."""
        if self._peer_streams is None:  # a stage built outside an agent (a test of its loading)
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{self.name} streams its neighbours' tensors: it needs its agent's peer streams")
        return StepWire(self, step, schedule, deadline, abort)

    def stream(self, which: str, deadline: float, abort: threading.Event) -> FrameStream:
        """The stream to the "prev" or "next" stage for a step: the one kept, while its other end has not closed it
        (nor, for "prev", dialled anew); else a new one."""
        stream = self._streams.get(which)
        redialled = which == "prev" and self._offers.kept(self._assignment.stage_index - 1) is not None
        if stream is not None and not stream.closed_by_peer() and not redialled:
            return stream
        if stream is not None:
            stream.close()
            del self._streams[which]
        peer = self._assignment.stage_index + (1 if which == "next" else -1)
        sock = self._dial(deadline) if which == "next" else self._offers.take(
            peer, deadline, abort, missing=f"stage {peer} opened no neighbour stream by the step's deadline")[1]
        stream = self._streams[which] = FrameStream(sock, FRAME.size, f"stage {peer}", self.name)
        return stream

    def _dial(self, deadline: float) -> ssl.SSLSocket:
        a = self._assignment
        assert self._next_stub is not None and self._peer_streams is not None and a.next_address is not None
        peer = f"stage {a.stage_index + 1} at {a.next_address}"
        target = stage_pb2.StageRef(job_id=a.job_id, stage_index=a.stage_index + 1, generation=a.generation)
        try:
            reply = self._next_stub.NeighbourStreamPort(
                stage_pb2.NeighbourStreamPortRequest(target=target), timeout=max(0.05, deadline - time.monotonic()))
        except grpc.RpcError as exc:
            raise RpcFailure(neighbour_failure_code(exc.code()),
                             f"{self.name} could not ask {peer} where it takes its neighbour stream: "
                             f"{exc.details()}") from None
        hello = NeighbourHello(a.job_id, a.stage_index + 1, a.generation, a.stage_index, a.credentials.token)
        return self._peer_streams.dial(a.next_address, reply.address, reply.port, a.certificates[a.next_address],
                                       hello.pack(), deadline, peer=peer)

    def close_streams(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()

    def close(self) -> None:
        self._offers.close()
        self.close_streams()
