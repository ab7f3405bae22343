"""`TensorParallelService` over gRPC: authorize the caller as the group's rank it claims to be, resolve the
addressed group (generation included), let it validate and park a peer's partial sum. Nothing here touches
torch."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from arceus.contracts.credentials import Role
from arceus.v1 import tensor_parallel_pb2, tensor_parallel_pb2_grpc
from nodeagent.all_reduce import TensorParallelGroups
from nodeagent.callers import Guard, authorize, presented_digest
from nodeagent.rpc import RpcFailure, serve

PEERS = frozenset({Role.PEER})


class TensorParallelServicer(tensor_parallel_pb2_grpc.TensorParallelServiceServicer):
    def __init__(self, groups: TensorParallelGroups, guards: Callable[[], list[Guard]]) -> None:
        """`guards`: whose calls the agent accepts (every stage's, and ranks still being built)."""
        self._groups = groups
        self._guards = guards

    def PushPartial(
        self, request: tensor_parallel_pb2.PushPartialRequest, context: grpc.ServicerContext
    ) -> tensor_parallel_pb2.PushPartialReply:
        def push() -> tensor_parallel_pb2.PushPartialReply:
            digest = presented_digest(context)
            guard = authorize(
                digest, self._guards(), target=request.target, allowed=PEERS, method="PushPartial"
            )
            if guard.credentials.rank_of(Role.PEER, digest or "") != request.source_rank:
                raise RpcFailure(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "a rank pushes its own partials only (source_rank is not the caller's)",
                )
            self._groups.resolve(request.target).accept(request)
            return tensor_parallel_pb2.PushPartialReply()

        return serve(context, "PushPartial", push)
