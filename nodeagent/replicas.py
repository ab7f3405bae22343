"""A replica of a replicated stage (arceus/swarm) on this agent: the step's routes and peers as RunStep names
them, links to the replicas it sends to (opened as steps name them), and the exact gradient exchange with its
siblings over `ReplicaService.PushShard` (cut and summed by arceus.swarm.exchange, so every replica holds the
same bits before the same optimizer step). Nothing here touches the stage's model."""

from __future__ import annotations

import hmac
import json
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from arceus.contracts.certificates import check_certificate
from arceus.contracts.credentials import REPLICA_METADATA_KEY
from arceus.errors import SpecError
from arceus.swarm.exchange import MAX_SHARD_BYTES, chunk_bounds, reduce_in_order, shard_bounds
from arceus.swarm.repair import ReplicaInstructions
from arceus.swarm.routing import Routes
from arceus.v1 import replica_pb2, stage_pb2
from arceus.verify.receipts import ReceiptError, ShardFields, verify_shard
from arceus.verify.tensor_digest import tensor_digest
from arceus.wire import codec
from arceus.wire.incoming_push import IncomingPush, MalformedPush
from arceus.wire.proto_tensor import decode_tensor
from arceus.wire.push_stream import encode_varint
from nodeagent import faults
from nodeagent.call_limits import CALLS_PER_CALLER, STREAMS_PER_CALLER
from nodeagent.callers import not_allowed
from nodeagent.mailbox import Mailbox, MailboxCancelled, MailboxClosed, MailboxFull, MailboxTimeout
from nodeagent.membership import Membership
from nodeagent.rpc import RpcFailure, neighbour_failure

_FLOAT32_BYTES = 4
# How often a wait for a shard's push looks whether its step was aborted.
ABORT_POLL_SECONDS = 0.05
# Shards in flight from one replica at once: the siblings' agents take a few calls per caller at a time
# (nodeagent.call_limits), and all replicas of a stage present the same bearer credential.
SENDS_IN_FLIGHT = 4
_PHASES = {replica_pb2.REDUCE: "REDUCE", replica_pb2.GATHER: "GATHER"}


def epoch_waits(max_replicas: int) -> int:
    """How many calls may legitimately wait at once at one replica for a membership epoch its own RunStep has not
    named yet, where a stage has at most `max_replicas` (the job's micro_batches): every sibling's shards in flight
    (SENDS_IN_FLIGHT each; the siblings are one caller, so at most CALLS_PER_CALLER), and one push on the stream of
    each replica of either neighbouring stage (each stage one caller, at most STREAMS_PER_CALLER streams)."""
    siblings = min((max_replicas - 1) * SENDS_IN_FLIGHT, CALLS_PER_CALLER)
    return siblings + 2 * min(max_replicas, STREAMS_PER_CALLER)
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


PUSH_SHARD_METHOD = "/arceus.v1.ReplicaService/PushShard"
_TENSOR_FIELD, _DATA_FIELD = b"\x3a", b"\x1a"  # PushShardRequest.tensor (7) and Tensor.data (3), length-delimited


class ShardLink(Protocol):
    """A sibling's `ReplicaService.PushShard` taking a request's wire bytes (`shard_request_bytes`): the link's
    `push_shard` (nodeagent.stage.NeighbourLink)."""

    push_shard: grpc.UnaryUnaryMultiCallable


def push_shard_call(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    """PushShard on `channel`, its requests sent as the bytes `shard_request_bytes` made."""
    return channel.unary_unary(PUSH_SHARD_METHOD, request_serializer=None,
                               response_deserializer=replica_pb2.PushShardReply.FromString)


def shard_request_bytes(header: replica_pb2.PushShardRequest, values: torch.Tensor) -> bytes:
    """The wire bytes of `header` (a PushShardRequest without its tensor) carrying `values` as its float32 tensor:
    the header, then a `tensor` record with dtype and shape, then one holding only `data` (protobuf merges a
    message's repeated records, so the receiver parses one tensor). `values` are copied once, into these bytes:
    set into the message and serialized, they were copied three times (and a Tensor built apart and passed to the
    constructor is merged field by field: 7.5 ms of CPU for a 3.2 MB shard, against 0.7 ms)."""
    values = values.detach().float().contiguous()
    data = memoryview(values.numpy()).cast("B")
    meta = stage_pb2.Tensor(dtype="float32", shape=[values.numel()]).SerializeToString()
    data_field = _DATA_FIELD + encode_varint(len(data))
    return b"".join((
        header.SerializeToString(), _TENSOR_FIELD, encode_varint(len(meta)), meta,
        _TENSOR_FIELD, encode_varint(len(data_field) + len(data)), data_field, data,
    ))


class ReplicaExchange:
    """The shards siblings push to this replica, waiting for its exchange, and its sends to them. Every shard
    comes from the replica it names: the sender presents its own replica token (`token` is this one's), whose
    digest the driver names for each member in every RunStep (`learn`)."""

    def __init__(self, *, job_id: str, stage_index: int, generation: int, replica: int, token: str,
                 total_elements: int, max_replicas: int) -> None:
        self.job_id, self.stage_index, self.generation, self.replica = job_id, stage_index, generation, replica
        self._metadata = ((REPLICA_METADATA_KEY, token),)
        # Who may push shards (and boundary tensors) to this replica, by their tokens, as its RunSteps name them.
        self.members = Membership(self.name, waiting_calls=epoch_waits(max_replicas))
        self.total_elements = total_elements
        # Per step a replica receives at most every member's shards of its own chunk and every owner's of the
        # others: at most about two stages' worth of shards, plus one per member for the rounding.
        per_stage = math.ceil(total_elements * _FLOAT32_BYTES / MAX_SHARD_BYTES) + max_replicas
        self.shards: Mailbox[tuple[str, torch.Tensor, bytes]] = Mailbox(capacity=2 * max_replicas * per_stage + 8)
        self.bytes_sent = 0  # tensor bytes pushed to siblings over the stage's life (only the step's thread adds)

    @property
    def name(self) -> str:
        return f"stage {self.stage_index} replica {self.replica} of job {self.job_id}"

    def accept(
        self, shard: IncomingPush[replica_pb2.PushShardRequest] | MalformedPush, sender: str | None, *, wait: float
    ) -> None:
        """Validate a sibling's shard (before torch sees it) and park it for `exchange`: its values stay a view of the
        received bytes (`arceus.wire.incoming_push.parse_shard`). `sender`: the digest of the replica token the call
        presents. Only a member of the shard's membership epoch, the newest this replica's RunSteps named,
        presenting its own token, may push a shard (nodeagent.membership): a replica no
        longer (or never) a member, or one claiming another's id, can neither have its shard summed nor take the
        place of a member's. A shard of an epoch no RunStep named here yet waits up to `wait` seconds (at most
        nodeagent.membership.EPOCH_WAIT_SECONDS) for one."""
        if sender is None:
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED, not_allowed("PushShard"))
        if isinstance(shard, MalformedPush):
            raise _invalid(shard.reason)
        request = shard.header
        if request.step < 0 or request.epoch < 0:
            raise _invalid(f"step and epoch must be >= 0, got step {request.step}, epoch {request.epoch}")
        if request.phase not in _PHASES:
            raise _invalid(f"phase must be REDUCE or GATHER, got {request.phase}")
        if request.source_replica < 0 or request.source_replica == self.replica:
            raise _invalid(f"source_replica must be another replica than {self.replica}, got {request.source_replica}")
        message = request.tensor
        if message.encoding or message.dtype != "float32" or len(message.shape) != 1:
            raise _invalid(f"a shard is an uncompressed float32 vector, got {message.dtype!r} {list(message.shape)}")
        length = message.shape[0]
        if not 1 <= length <= MAX_SHARD_BYTES // _FLOAT32_BYTES:
            raise _invalid(f"a shard holds 1 to {MAX_SHARD_BYTES // _FLOAT32_BYTES} elements, got {length}")
        if not 0 <= request.start <= self.total_elements - length:
            raise _invalid(
                f"elements [{request.start}, {request.start + length}) are outside this stage's {self.total_elements}"
            )
        what = f"a {_PHASES[request.phase]} shard of step {request.step} from replica {request.source_replica}"
        self.members.check(request.epoch, self.stage_index, request.source_replica, sender, what=what,
                           method="PushShard", wait=wait)
        try:
            # A read-only view of the received bytes, not a copy: the exchange only reads it (sums it, or copies it
            # into its result).
            tensor = decode_tensor(message, shard.data, shard.scales, shard.indices,
                                   max_bytes=length * _FLOAT32_BYTES, copy=False)
        except codec.TensorValidationError as exc:
            raise _invalid(f"shard rejected: {exc}") from None
        key = _mail_key(request.step, request.epoch, request.phase, request.source_replica, request.start)
        try:
            self.shards.put(key, (sender, tensor, request.signature))
        except MailboxFull as exc:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name}: {exc}") from None
        except MailboxClosed:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"{self.name} was just removed from this agent") from None

    def exchange(
        self,
        flat: torch.Tensor,
        *,
        step: int,
        epoch: int,
        members: tuple[int, ...],
        link: Callable[[int], ShardLink],
        deadline: float,
        abort: threading.Event,
        sign: Callable[[ShardFields], bytes] | None = None,
        keys: Mapping[int, str] | None = None,
        kept: list[stage_pb2.ShardReceipt] | None = None,
    ) -> torch.Tensor:
        """The sum over `members` of their `flat` gradients: reduce-scatter to each chunk's owner, which sums
        in ascending replica id, then all-gather from the owners. `link(replica)`: the link to the sibling.
        An audited step (arceus.training.audit) signs each shard it pushes with `sign`, and keeps in `kept` each
        shard a sibling pushed here, with the signature checked against the sibling's key in `keys` (a shard that
        carries none, or one that does not verify, fails the step: PERMISSION_DENIED naming the sibling)."""
        chunks = chunk_bounds(flat.numel(), members)
        # Shards of an earlier membership of this step (a repaired step exchanges again) are never summed.
        current = f" of epoch {epoch} from "
        self.shards.discard(lambda key: key[0] == step and current not in key[1])
        sends: deque[tuple[int, grpc.Future]] = deque()

        def settle(to: int, future: grpc.Future) -> None:
            try:
                while True:  # a sibling that went silent holds a push until the deadline: an abort ends the wait
                    try:
                        future.result(timeout=ABORT_POLL_SECONDS)
                        return
                    except grpc.FutureTimeoutError:
                        if abort.is_set():
                            future.cancel()
                            raise RpcFailure(
                                grpc.StatusCode.CANCELLED, f"{self.name}: the step was cancelled"
                            ) from None
            except grpc.RpcError as exc:
                raise neighbour_failure(exc, f"{self.name}: pushing a shard of step {step} to replica {to}") from None

        def push(to: int, phase: int, start: int, values: torch.Tensor) -> None:
            header = replica_pb2.PushShardRequest(
                target=stage_pb2.StageRef(
                    job_id=self.job_id, stage_index=self.stage_index, generation=self.generation, replica=to
                ),
                step=step, epoch=epoch, source_replica=self.replica, phase=phase, start=start,
            )
            if sign is not None and phase == replica_pb2.REDUCE:
                header.signature = sign(self._shard_fields(step, epoch, self.replica, start, values))
            request = shard_request_bytes(header, values)
            self.bytes_sent += values.numel() * values.element_size()
            if len(sends) >= SENDS_IN_FLIGHT:
                settle(*sends.popleft())
            timeout = max(0.05, deadline - time.monotonic())
            sends.append((to, link(to).push_shard.future(request, timeout=timeout, metadata=self._metadata)))

        def receive(phase: int, source: int, start: int, end: int) -> torch.Tensor:
            key = _mail_key(step, epoch, phase, source, start)
            try:
                sender, part, signature = self.shards.get(key, max(0.0, deadline - time.monotonic()), abort)
            except MailboxTimeout:
                raise RpcFailure(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.name}: replica {source} sent no {_PHASES[phase]} shard at element {start} of step {step}",
                ) from None
            except MailboxClosed:
                raise RpcFailure(grpc.StatusCode.ABORTED, f"{self.name} was removed mid-step") from None
            except MailboxCancelled:
                raise RpcFailure(grpc.StatusCode.CANCELLED, f"{self.name}: the step was cancelled") from None
            if not hmac.compare_digest(sender, self.members.digest(epoch, self.stage_index, source) or ""):
                raise RpcFailure(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{self.name}: the shard at element {start} of step {step} claiming replica {source} came from "
                    "another replica",
                )
            if part.numel() != end - start:
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.name}: replica {source}'s shard at element {start} holds {part.numel()} elements, "
                    f"not {end - start}",
                )
            if kept is not None and phase == replica_pb2.REDUCE:
                kept.append(self._evidence(step, epoch, source, start, part, signature, (keys or {}).get(source)))
            return part

        for chunk in chunks:
            if chunk.owner != self.replica:
                for start, end in shard_bounds(chunk, _FLOAT32_BYTES):
                    push(chunk.owner, replica_pb2.REDUCE, start, flat[start:end])
        # A test hook (nodeagent.faults): this replica's shards are out, the sums not yet back.
        faults.reached("exchange", step, stage=self.stage_index, replica=self.replica)
        out = torch.empty_like(flat)
        others = [k for k in members if k != self.replica]
        for chunk in chunks:
            if chunk.owner != self.replica:
                continue
            for start, end in shard_bounds(chunk, _FLOAT32_BYTES):
                parts = {self.replica: flat[start:end]}
                parts.update({k: receive(replica_pb2.REDUCE, k, start, end) for k in others})
                reduce_in_order(parts, out=out[start:end])
                for k in others:
                    push(k, replica_pb2.GATHER, start, out[start:end])
        for chunk in chunks:
            if chunk.owner != self.replica:
                for start, end in shard_bounds(chunk, _FLOAT32_BYTES):
                    out[start:end] = receive(replica_pb2.GATHER, chunk.owner, start, end)
        while sends:
            settle(*sends.popleft())
        return out

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
        self.shards.close()


def _mail_key(step: int, epoch: int, phase: int, source: int, start: int) -> tuple[int, str, int]:
    return (step, f"{_PHASES[phase]} of epoch {epoch} from replica {source}", start)


def _invalid(message: str) -> RpcFailure:
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message)
