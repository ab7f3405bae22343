"""`ReplicaService` over gRPC: authorize the caller as a sibling (a replica of the same stage, job and
generation), resolve the addressed replica, let its exchange validate and park the shard. Nothing here touches
torch."""

from __future__ import annotations

import grpc

from arceus.contracts.credentials import Role
from arceus.v1 import replica_pb2, replica_pb2_grpc
from nodeagent.callers import authorize, presented_digest
from nodeagent.hosting import HostedStages
from nodeagent.rpc import RpcFailure, serve

SIBLINGS = frozenset({Role.SIBLING})


class ReplicaServicer(replica_pb2_grpc.ReplicaServiceServicer):
    def __init__(self, registry: HostedStages) -> None:
        self._registry = registry

    def PushShard(
        self, request: replica_pb2.PushShardRequest, context: grpc.ServicerContext
    ) -> replica_pb2.PushShardReply:
        def push() -> replica_pb2.PushShardReply:
            authorize(
                presented_digest(context), self._registry.guards(), target=request.target, allowed=SIBLINGS,
                method="PushShard",
            )
            stage = self._registry.resolve(request.target)
            if stage.exchange is None:
                raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"{stage.name} is not replicated")
            stage.exchange.accept(request)
            return replica_pb2.PushShardReply()

        return serve(context, "PushShard", push)
