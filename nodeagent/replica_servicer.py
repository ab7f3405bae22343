"""`ReplicaService` over gRPC: authorize the caller (a sibling: a replica of the same stage, job and generation; or,
for CopyState and Holdings, the driver), resolve the addressed replica, and tell a sibling where the exchange's
streams are taken (ExchangePort; the exchange itself runs outside gRPC: nodeagent.exchange_stream), stream its state
between steps (Snapshot), copy a live sibling's state (CopyState), or tell the driver what it holds of a step that
lost replicas (Holdings). Nothing here touches torch but loading a copied state.

A sibling also presents its own replica token (arceus.contracts.credentials.replica_token): a replica's state goes
only to the joiner the driver named, whose SnapshotRequest carries the driver's grant for that joiner's token
(`join_grant`, checked with this replica's own token). A sibling without one is refused with the same words whatever
it asked, learning nothing of the state."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterator

import grpc

from arceus.checkpoint import checkpoint_views, state_chunks
from arceus.contracts.certificates import check_certificate
from arceus.contracts.credentials import REPLICA_METADATA_KEY, Role, join_grant
from arceus.safetensors_file import header_handle, tensor_layouts
from arceus.v1 import replica_pb2, replica_pb2_grpc, stage_pb2
from nodeagent.callers import DRIVER_ONLY, authorize, not_allowed, presented_digest, replica_digest
from nodeagent.hosting import HostedStages
from nodeagent.peer_streams import PeerStreams
from nodeagent.rpc import RpcFailure, call_deadline, serve
from nodeagent.runtime import StageRuntime
from nodeagent.servicer import state_stream
from nodeagent.stage import HostedStage

SIBLINGS = frozenset({Role.SIBLING})
# Room for a state file's safetensors header beside its tensors.
HEADER_ALLOWANCE = 1 << 20


class ReplicaServicer(replica_pb2_grpc.ReplicaServiceServicer):
    def __init__(self, registry: HostedStages, streams: PeerStreams) -> None:
        self._registry = registry
        self._streams = streams

    def _replica(
        self, context: grpc.ServicerContext, target: stage_pb2.StageRef, method: str, roles: frozenset[Role]
    ) -> HostedStage:
        authorize(presented_digest(context), self._registry.guards(), target=target, allowed=roles, method=method)
        stage = self._registry.resolve(target)
        if stage.exchange is None:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"{stage.name} is not replicated")
        return stage

    def ExchangePort(
        self, request: replica_pb2.ExchangePortRequest, context: grpc.ServicerContext
    ) -> replica_pb2.ExchangePortReply:
        def port() -> replica_pb2.ExchangePortReply:
            stage = self._replica(context, request.target, "ExchangePort", SIBLINGS)
            assert stage.exchange is not None  # noqa: S101 (_replica refused a stage that is not replicated)
            # The caller dials next: wait for this replica to learn the caller's epoch, and with it its certificate.
            stage.exchange.members.wait_for(request.epoch, wait=context.time_remaining() or 0.0,
                                            what="a request for the exchange port")
            return replica_pb2.ExchangePortReply(port=self._streams.port)

        return serve(context, "ExchangePort", port)

    def Snapshot(
        self, request: replica_pb2.SnapshotRequest, context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.StateChunk]:
        """This replica's state (weights, optimizer state and the buffers training updates, after its last step's
        update) in chunks of a few MiB,
        the step lock held until the last one."""

        def settled() -> HostedStage:
            stage = self._replica(context, request.target, "Snapshot", SIBLINGS)
            joiner = replica_digest(context)
            own = stage.assignment.credentials.replica_token
            # A grant of an older membership than the newest this replica's steps named is spent: refused alike.
            current = request.epoch >= stage.exchange.members.newest
            if joiner is None or not current or not hmac.compare_digest(
                request.grant, join_grant(own, joiner, request.epoch)
            ):
                raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED, not_allowed("Snapshot"))
            stage.hold_between_steps(call_deadline(context) - time.monotonic())
            return stage

        stage = serve(context, "Snapshot", settled)
        yield from state_stream(stage)

    def CopyState(
        self, request: replica_pb2.CopyStateRequest, context: grpc.ServicerContext
    ) -> replica_pb2.CopyStateReply:
        """Replace this (joining) replica's state with a live sibling's, fetched from it peer to peer."""

        def copy() -> replica_pb2.CopyStateReply:
            stage = self._replica(context, request.target, "CopyState", DRIVER_ONLY)
            source = request.source
            if source.stage_index != request.target.stage_index or source.replica == request.target.replica:
                raise RpcFailure(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the source must be another replica of stage {request.target.stage_index}, got stage "
                    f"{source.stage_index} replica {source.replica}",
                )
            try:
                check_certificate(source.certificate)
            except ValueError as exc:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"source.certificate: {exc}") from None
            deadline = call_deadline(context)
            stage.hold_between_steps(deadline - time.monotonic())
            try:
                data = _fetch_snapshot(stage, source, request.grant, request.epoch, deadline)
                try:
                    stage.runtime.load_state_tensors(checkpoint_views(data))  # copied into place from `data`
                except ValueError as exc:  # a file that is no state of this stage
                    raise RpcFailure(
                        grpc.StatusCode.FAILED_PRECONDITION, f"replica {source.replica}'s state does not fit: {exc}"
                    ) from None
                copied, held = hashlib.sha256(data).hexdigest(), state_digest(stage.runtime, order=data)
            finally:
                stage.step_lock.release()
            if held != copied:
                raise RpcFailure(
                    grpc.StatusCode.DATA_LOSS,
                    f"{stage.name} loaded replica {source.replica}'s state (sha256 {copied}) but holds sha256 {held}",
                )
            return replica_pb2.CopyStateReply(sha256=copied, size_bytes=len(data), state_sha256=held)

        return serve(context, "CopyState", copy)

    def Holdings(
        self, request: replica_pb2.HoldingsRequest, context: grpc.ServicerContext
    ) -> replica_pb2.HoldingsReply:
        """What this replica holds of step `request.step` (nodeagent.repair), once its step stopped and its sends
        settled: the driver plans a repair from every survivor's. Nothing (`[]`) where it holds no record of it. Nothing
        of an epoch before `request.epoch` is taken from the call on (nodeagent.membership.Membership.fence)."""

        def holdings() -> replica_pb2.HoldingsReply:
            stage = self._replica(context, request.target, "Holdings", DRIVER_ONLY)
            stage.exchange.members.fence(request.epoch)  # a late tensor of the step's old epoch is refused from now
            if not stage.assignment.replica_sync.exact:
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{stage.name} syncs with its siblings every few steps: what a lost sibling trained alone is gone "
                    "with it, and no repair brings it back",
                )
            if not stage.step_lock.acquire(timeout=max(0.0, call_deadline(context) - time.monotonic())):
                raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{stage.name} stayed busy with a step")
            try:
                held = stage.held_step
                if held is None or held.step != request.step:
                    return replica_pb2.HoldingsReply(holdings_json="[]")
                a = stage.assignment
                arrived = set(stage.mailbox.arrived(request.step))
                return replica_pb2.HoldingsReply(
                    holdings_json=json.dumps(held.holdings(a.stage_index, a.replica, arrived).to_json()),
                    exchanged_epoch=held.exchanged_epoch,
                )
            finally:
                stage.step_lock.release()

        return serve(context, "Holdings", holdings)


def state_digest(runtime: StageRuntime, *, order: bytes) -> str:
    """The SHA-256 (hex) of a stage's state (weights, optimizer state and buffers) written as Snapshot writes it, its
    tensors in the order of the state file `order` (a loaded optimizer may keep its entries in another order than
    the one that wrote them): the file's own digest exactly when this stage holds every tensor of it, bit for bit."""
    held = dict(runtime.state_items())
    names = list(tensor_layouts(header_handle(order), len(order)))
    if set(names) == set(held):
        held = {name: held[name] for name in names}
    digest = hashlib.sha256()
    _, chunks = state_chunks(held)
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def _fetch_snapshot(
    stage: HostedStage, source: stage_pb2.ReplicaPeer, grant: str, epoch: int, deadline: float
) -> bytearray:
    """The source replica's state file, read only up to what this stage's state can take (weights and as many
    tensors per weight as its optimizer keeps, its buffers, and a header), presenting this replica's token and the
    driver's `grant` for it at membership `epoch`. The one buffer it arrived into: the stage loads its tensors as
    views of it (a copy would take another state's memory beside the stage's own, a GB per 100M parameters with
    momentum)."""
    runtime = stage.runtime
    weights = sum(p.numel() * p.element_size() for p in runtime.layers.parameters())
    buffers = sum(b.numel() * b.element_size() for b in runtime.buffers.buffers)
    limit = weights * (1 + len(runtime.optimizer_state_keys())) + buffers + HEADER_ALLOWANCE
    ref = stage.ref(stage.assignment.stage_index, source.replica)
    chunks = stage.replica_link(source).replicas.Snapshot(
        replica_pb2.SnapshotRequest(target=ref, grant=grant, epoch=epoch),
        timeout=max(0.05, deadline - time.monotonic()),
        metadata=((REPLICA_METADATA_KEY, stage.assignment.credentials.replica_token),),
    )
    data = bytearray()
    try:
        for chunk in chunks:
            data += chunk.data
            if len(data) > limit:
                chunks.cancel()
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"replica {source.replica}'s state exceeds the {limit:,} bytes this stage's state can take",
                )
    except grpc.RpcError as exc:
        raise RpcFailure(
            grpc.StatusCode.UNAVAILABLE,
            f"copying the state of replica {source.replica} at {source.address} failed: "
            f"{exc.code().name}: {exc.details()}",
        ) from None
    return data
