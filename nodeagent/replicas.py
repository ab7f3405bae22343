"""A replica of a replicated stage (arceus/swarm) on this agent: the step's routes and peers as RunStep names
them, and the exact gradient exchange with its siblings over one stream per sibling (nodeagent.exchange_stream; cut
and summed by arceus.swarm.exchange, so every replica holds the same bits before the same optimizer step). Nothing
here touches the stage's model."""

from __future__ import annotations

import functools
import hmac
import json
import re
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
import torch

from arceus.contracts.certificates import check_certificate
from arceus.errors import SpecError
from arceus.swarm.exchange import chunk_bounds, reduce_in_order, shard_bounds
from arceus.swarm.repair import ReplicaInstructions
from arceus.swarm.routing import Routes
from arceus.v1 import stage_pb2
from arceus.verify.receipts import ReceiptError, ShardFields, verify_shard
from arceus.verify.tensor_digest import tensor_digest
from nodeagent import faults
from nodeagent.call_limits import STREAMS_PER_CALLER
from nodeagent.exchange_stream import GATHER, PHASES, REDUCE, Expected, Hello, Stream
from nodeagent.membership import Membership
from nodeagent.peer_streams import Offers, PeerStreams, pump_all
from nodeagent.rpc import RpcFailure

_FLOAT32_BYTES = 4


def epoch_waits(max_replicas: int) -> int:
    """How many calls may legitimately wait at once at one replica for a membership epoch its own RunStep has not
    named yet, where a stage has at most `max_replicas` (the job's micro_batches): one push on the stream of each
    replica of either neighbouring stage (each stage one caller, at most STREAMS_PER_CALLER streams). (Siblings'
    exchange streams wait in no call: nodeagent.exchange_stream.)"""
    return 2 * min(max_replicas, STREAMS_PER_CALLER)


_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ReplicaStepPlan:
    """One step of this replica: the routes, its own micro-batches and where every replica it talks to
    listens ((stage, replica) -> ReplicaPeer)."""

    routes: Routes
    epoch: int
    replica: int
    micro_batches: tuple[int, ...]
    peers: Mapping[tuple[int, int], stage_pb2.ReplicaPeer]
    # Set when the driver resumes a step that lost replicas (arceus.swarm.repair): what this replica does then.
    repair: ReplicaInstructions | None = None

    @property
    def most_replicas(self) -> int:
        return max(len(ids) for ids in self.routes.members)

    def members(self, stage: int) -> tuple[int, ...]:
        return self.routes.members[stage]


def parse_replica_step(
    request: stage_pb2.RunStepRequest, *, stage_index: int, num_stages: int, replica: int
) -> ReplicaStepPlan:
    """Check a RunStep's `replicas` against this replica (INVALID_ARGUMENT naming what is wrong)."""
    swarm = request.replicas
    try:
        routes = Routes.from_json(json.loads(swarm.routes_json), "replicas.routes")
    except json.JSONDecodeError as exc:
        raise _invalid(f"replicas.routes_json is not JSON: {exc}") from None
    except SpecError as exc:
        raise _invalid(f"{exc.field}: {exc.message}") from None
    if routes.num_stages != num_stages:
        raise _invalid(f"replicas.routes name {routes.num_stages} stages; the pipeline has {num_stages}")
    if routes.num_micro_batches != request.num_micro_batches:
        raise _invalid(
            f"replicas.routes route {routes.num_micro_batches} micro-batches; the step has {request.num_micro_batches}"
        )
    if replica not in routes.members[stage_index]:
        raise _invalid(f"replica {replica} is not a member of stage {stage_index} in this step's routes")
    if swarm.epoch < 0:
        raise _invalid(f"replicas.epoch must be >= 0, got {swarm.epoch}")
    peers: dict[tuple[int, int], stage_pb2.ReplicaPeer] = {}
    for peer in swarm.peers:
        key = (peer.stage_index, peer.replica)
        if key in peers:
            raise _invalid(f"replicas.peers names stage {key[0]} replica {key[1]} twice")
        if ":" not in peer.address:
            raise _invalid(f"replicas.peers: stage {key[0]} replica {key[1]} has no host:port address")
        try:
            check_certificate(peer.certificate)
        except ValueError as exc:
            raise _invalid(f"replicas.peers: stage {key[0]} replica {key[1]}: {exc}") from None
        if not _HEX64.fullmatch(peer.token_digest):
            raise _invalid(f"replicas.peers: stage {key[0]} replica {key[1]}'s token_digest is no SHA-256 (hex)")
        if peer.public_key and not _HEX64.fullmatch(peer.public_key):
            raise _invalid(f"replicas.peers: stage {key[0]} replica {key[1]}'s public_key is no Ed25519 key (hex)")
        peers[key] = peer
    needed = [
        (i, k) for i in (stage_index - 1, stage_index, stage_index + 1) if 0 <= i < num_stages
        for k in routes.members[i] if (i, k) != (stage_index, replica)
    ]
    if missing := [key for key in needed if key not in peers]:
        raise _invalid(f"replicas.peers lacks stage/replica {missing}: every member of this stage and its neighbours")
    mine = routes.micro_batches_of(stage_index, replica)
    repair = _repair(swarm.repair_json, routes, stage_index, mine) if swarm.repair_json else None
    if repair is not None and request.mode != stage_pb2.TRAIN:
        raise _invalid("replicas.repair_json: only a train step is repaired")
    return ReplicaStepPlan(routes, swarm.epoch, replica, mine, peers, repair)


def _repair(text: str, routes: Routes, stage: int, mine: tuple[int, ...]) -> ReplicaInstructions:
    """A repair's instructions for this replica, checked against the step's routes: each micro-batch named is
    routed to it, and each re-send goes to the neighbour's replica its route names."""
    try:
        repair = ReplicaInstructions.from_json(json.loads(text), "replicas.repair")
    except json.JSONDecodeError as exc:
        raise _invalid(f"replicas.repair_json is not JSON: {exc}") from None
    except SpecError as exc:
        raise _invalid(f"{exc.field}: {exc.message}") from None
    named = [*repair.recompute, *repair.skip_output, *repair.skip_input_gradient,
             *(m for m, _ in repair.resend_outputs), *(m for m, _ in repair.resend_input_gradients)]
    if stray := sorted({m for m in named if m not in mine}):
        raise _invalid(f"replicas.repair names micro-batches {stray}, which the routes do not give this replica")
    for field, pairs, to_stage in (("resend_outputs", repair.resend_outputs, stage + 1),
                                   ("resend_input_gradients", repair.resend_input_gradients, stage - 1)):
        for m, to in pairs:
            if not 0 <= to_stage < routes.num_stages or routes.of[m][to_stage] != to:
                raise _invalid(f"replicas.repair.{field}: micro-batch {m} to replica {to} is not where its route goes")
    return repair


class ReplicaExchange:
    """This replica's exact exchange with its siblings over one stream per sibling (nodeagent.exchange_stream), opened
    once per membership epoch. Every stream comes from the replica it names: the sibling's hello presents its own
    replica token (`token` is this one's), whose digest the driver names for each member in every RunStep (`learn`),
    over TLS from the certificate the step names for it."""

    def __init__(self, *, job_id: str, stage_index: int, generation: int, replica: int, token: str,
                 total_elements: int, max_replicas: int, streams: PeerStreams) -> None:
        self.job_id, self.stage_index, self.generation, self.replica = job_id, stage_index, generation, replica
        self._token = token
        self._wire = streams
        self._max_replicas = max_replicas
        # Who may send shards (and boundary tensors) to this replica, by their tokens, as its RunSteps name them.
        self.members = Membership(self.name, waiting_calls=epoch_waits(max_replicas))
        self.total_elements = total_elements
        self.bytes_sent = 0  # tensor bytes sent to siblings over the stage's life (only the step's thread adds)
        self._streams: dict[int, Stream] = {}  # sibling -> its stream, of membership epoch `_streams_epoch`
        self._streams_epoch = -1
        # Streams siblings opened to this replica, until its exchange takes them: by sibling, with the epoch and
        # token digest their hellos named.
        self._offers: Offers[int, tuple[int, str]] = Offers(self.name)
        self._inbox: dict[int, torch.Tensor] = {}  # sibling -> where its REDUCE shards of this replica's chunk land

    @property
    def name(self) -> str:
        return f"stage {self.stage_index} replica {self.replica} of job {self.job_id}"

    def learn(self, epoch: int, peers: Iterable[stage_pb2.ReplicaPeer]) -> None:
        """A RunStep's membership: who may send to this replica in `epoch` (nodeagent.membership), and the
        certificates its siblings' streams may present."""
        peers = list(peers)
        # Trusted first: ExchangePort answers a sibling as soon as the epoch is known here, and the sibling dials at
        # once. (A RunStep refused for an epoch that is over comes from the driver all the same, and a stream's
        # hello is still judged by the membership.)
        self._wire.trust(p.certificate for p in peers if p.stage_index == self.stage_index)
        self.members.learn(epoch, peers)

    def offer(self, hello: Hello, sock: ssl.SSLSocket) -> None:
        """A stream a sibling opened (the listener's thread): kept for the exchange of its epoch, or refused (an
        RpcFailure; the listener closes it). A stream of an epoch this replica's RunSteps named is checked at once;
        one of an epoch still to come is kept (one per sibling) and checked when the exchange takes it."""
        source = hello.source
        if source == self.replica or not 0 <= source < self._max_replicas:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: no stream from replica {source}")
        if hello.epoch <= self.members.newest:
            self.members.check(hello.epoch, self.stage_index, source, hello.token_digest,
                               what=f"a stream from replica {source}", method="exchange stream", wait=0.0)
        self._offers.put(source, (hello.epoch, hello.token_digest), sock)

    def exchange(
        self,
        flat: torch.Tensor,
        *,
        step: int,
        epoch: int,
        members: tuple[int, ...],
        peers: Mapping[int, stage_pb2.ReplicaPeer],
        port_of: Callable[[int], int],
        deadline: float,
        abort: threading.Event,
        sign: Callable[[ShardFields], bytes] | None = None,
        keys: Mapping[int, str] | None = None,
        kept: list[stage_pb2.ShardReceipt] | None = None,
    ) -> torch.Tensor:
        """The sum over `members` of their `flat` gradients (float32, on the CPU): reduce-scatter to each chunk's
        owner, which sums in ascending replica id, then all-gather from the owners. `peers`: each sibling as the step
        names it; `port_of(sibling)`: its exchange listener's port, asked before this replica dials it wherever the
        stream goes (answered once the sibling learnt `epoch`, and so trusts this replica's certificate).
        An audited step (arceus.training.audit) signs each shard it sends with `sign`, and keeps in `kept` each
        shard a sibling sent here, with the signature checked against the sibling's key in `keys` (a shard that
        carries none, or one that does not verify, fails the step: PERMISSION_DENIED naming the sibling).
        Any failure closes this replica's streams: the next exchange opens them anew."""
        if flat.dtype != torch.float32 or flat.device.type != "cpu" or flat.dim() != 1:
            raise ValueError(f"the exchange takes a float32 vector on the CPU, got {flat.dtype} {list(flat.shape)} "
                             f"on {flat.device}")
        if epoch != self._streams_epoch:  # a new membership: new streams
            self._close_streams()
            self._streams_epoch = epoch
        try:
            return self._exchange(flat.detach().contiguous(), step, epoch, members, peers, port_of, deadline, abort,
                                  sign, keys or {}, kept)
        except RpcFailure as exc:
            self._close_streams()
            raise RpcFailure(exc.code, exc.message if exc.message.startswith(self.name) else
                             f"{self.name}: {exc.message}") from None
        except BaseException:
            self._close_streams()
            raise

    def _exchange(
        self, flat: torch.Tensor, step: int, epoch: int, members: tuple[int, ...],
        peers: Mapping[int, stage_pb2.ReplicaPeer], port_of: Callable[[int], int], deadline: float,
        abort: threading.Event, sign: Callable[[ShardFields], bytes] | None, keys: Mapping[int, str],
        kept: list[stage_pb2.ShardReceipt] | None,
    ) -> torch.Tensor:
        chunks = chunk_bounds(flat.numel(), members)
        others = [k for k in members if k != self.replica]
        streams = {k: self._stream(k, epoch, peers[k], port_of, deadline, abort) for k in others}
        out = torch.empty_like(flat)
        mine = next(c for c in chunks if c.owner == self.replica)
        inbox = self._inbox_of(others, mine.end - mine.start)
        shards = shard_bounds(mine, _FLOAT32_BYTES)
        arrived = [0] * len(shards)
        signatures: dict[tuple[int, int], bytes] = {}

        def reduced_in(j: int, source: int, signature: bytes) -> None:
            """A sibling's REDUCE shard `j` of this replica's chunk is in: once every sibling's is, its sum goes
            back to each of them."""
            signatures[(j, source)] = signature
            arrived[j] += 1
            if arrived[j] < len(others):
                return
            start, end = shards[j]
            parts = {self.replica: flat[start:end]}
            parts.update({k: inbox[k][start - mine.start:end - mine.start] for k in others})
            if kept is not None:
                for k in others:
                    kept.append(self._evidence(step, epoch, k, start, parts[k], signatures[(j, k)], keys.get(k)))
            reduce_in_order(parts, out=out[start:end])
            for k in others:
                self._send(streams[k], step, epoch, GATHER, start, out[start:end])

        for k in others:
            for j, (start, end) in enumerate(shards):
                streams[k].expect(Expected(step, epoch, REDUCE, start, end - start,
                                           _bytes(inbox[k][start - mine.start:end - mine.start]),
                                           functools.partial(reduced_in, j, k)))
            for start, end in shard_bounds(chunks[members.index(k)], _FLOAT32_BYTES):
                streams[k].expect(Expected(step, epoch, GATHER, start, end - start, _bytes(out[start:end]), _nothing))
        for chunk in chunks:
            if chunk.owner != self.replica:
                for start, end in shard_bounds(chunk, _FLOAT32_BYTES):
                    values = flat[start:end]
                    signature = sign(self._shard_fields(step, epoch, self.replica, start, values)) if sign else b""
                    self._send(streams[chunk.owner], step, epoch, REDUCE, start, values, signature)
        for stream in streams.values():  # as much as the sockets take at once
            stream.pump()
        # A test hook (nodeagent.faults): this replica's shards are on their way, the sums not yet back.
        faults.reached("exchange", step, stage=self.stage_index, replica=self.replica)

        def waiting_for() -> str:
            for k, stream in streams.items():
                frame = stream.next_expected()
                if isinstance(frame, Expected):
                    return (f"replica {k} sent no {PHASES[frame.phase]} shard at element {frame.start} of step "
                            f"{step}")
            return f"replicas {[k for k, s in streams.items() if s.sending]} took no more of this replica's shards"

        pump_all(streams.values(), deadline=deadline, abort=abort,
                 done=lambda: all(s.idle for s in streams.values()), waiting_for=waiting_for)
        return out

    def _send(self, stream: Stream, step: int, epoch: int, phase: int, start: int, values: torch.Tensor,
              signature: bytes = b"") -> None:
        stream.send_shard(step, epoch, phase, start, _bytes(values), signature)
        self.bytes_sent += values.numel() * _FLOAT32_BYTES

    def _stream(self, sibling: int, epoch: int, peer: stage_pb2.ReplicaPeer, port_of: Callable[[int], int],
                deadline: float, abort: threading.Event) -> Stream:
        """The stream to `sibling` in `epoch`: dialled where this replica's id is the lower, else the one the sibling
        opened, checked to be the sibling's (its token and certificate as the step names them)."""
        stream = self._streams.get(sibling)
        if stream is not None and not stream.closed_by_peer() and not (
            sibling < self.replica and self._redialled(sibling, epoch)
        ):
            return stream
        if stream is not None:  # the sibling's exchange failed on its side alone: it closed its end, or dialled anew
            stream.close()
        if self.replica < sibling:
            hello = Hello(self.job_id, self.stage_index, self.generation, sibling, self.replica, epoch, self._token)
            # Asked wherever the stream goes: the sibling answers once a RunStep of `epoch` reached it, so it trusts
            # this replica's certificate by the time the stream's handshake comes.
            port = port_of(sibling)
            sock = self._wire.dial(peer.address, peer.exchange_address, port, peer.certificate, hello.pack(), deadline,
                                   peer=f"replica {sibling}")
        else:
            sock = self._take_offer(sibling, epoch, peer, deadline, abort)
        stream = self._streams[sibling] = Stream(sock, sibling, self.name)
        return stream

    def _redialled(self, sibling: int, epoch: int) -> bool:
        kept = self._offers.kept(sibling)
        return kept is not None and kept[0][0] == epoch

    def _take_offer(self, sibling: int, epoch: int, peer: stage_pb2.ReplicaPeer, deadline: float,
                    abort: threading.Event) -> ssl.SSLSocket:
        (offered_epoch, digest), sock = self._offers.take(
            sibling, deadline, abort, missing=f"replica {sibling} opened no exchange stream of epoch {epoch}",
            stale=lambda said: said[0] < epoch)  # a stream of an earlier membership: over
        member = self.members.digest(epoch, self.stage_index, sibling) or ""
        try:
            certificate = ssl.PEM_cert_to_DER_cert(peer.certificate)
        except ValueError:
            certificate = b""
        if offered_epoch != epoch or not hmac.compare_digest(digest, member) or \
                sock.getpeercert(binary_form=True) != certificate:
            sock.close()
            raise RpcFailure(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the exchange stream claiming replica {sibling} of epoch {epoch} came from another replica "
                f"(or epoch {offered_epoch})",
            )
        return sock

    def _inbox_of(self, others: list[int], elements: int) -> dict[int, torch.Tensor]:
        """Where each sibling's REDUCE shards of this replica's chunk land: allocated once, kept step after step."""
        for k in others:
            if k not in self._inbox or self._inbox[k].numel() != elements:
                self._inbox[k] = torch.empty(elements, dtype=torch.float32)
        return self._inbox

    def _close_streams(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()

    def _shard_fields(self, step: int, epoch: int, source: int, start: int, values: torch.Tensor) -> ShardFields:
        return ShardFields(self.job_id, self.stage_index, self.generation, step, epoch, source, start, values.numel(),
                           tensor_digest(values))

    def _evidence(
        self, step: int, epoch: int, source: int, start: int, part: torch.Tensor, signature: bytes, key: str | None
    ) -> stage_pb2.ShardReceipt:
        """A sibling's signed shard as this replica summed it, once its signature verifies against `key`."""
        fields = self._shard_fields(step, epoch, source, start, part)
        try:
            if not key:
                raise ReceiptError("the step names no key for it")
            verify_shard(key, fields, signature)
        except ReceiptError as exc:
            raise RpcFailure(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self.name}: replica {source}'s shard at element {start} of audited step {step} is not signed "
                f"by it: {exc}",
            ) from None
        return stage_pb2.ShardReceipt(source_replica=source, epoch=epoch, start=start, length=part.numel(),
                                      sha256=fields.sha256, signature=signature)

    def close(self) -> None:
        self._offers.close()
        self._close_streams()


def _bytes(values: torch.Tensor) -> memoryview:
    """The bytes of a contiguous float32 vector, shared with it."""
    return memoryview(values.numpy()).cast("B")


def _nothing(signature: bytes) -> None:
    """A GATHER shard needs nothing once in: it was read into the result."""


def _invalid(message: str) -> RpcFailure:
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message)
