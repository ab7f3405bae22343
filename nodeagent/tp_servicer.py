"""`TensorParallelService` over gRPC: resolve the addressed group (generation included), let it validate
and park a peer's partial sum. Nothing here touches torch."""

from __future__ import annotations

import grpc

from arceus.v1 import tensor_parallel_pb2, tensor_parallel_pb2_grpc
from nodeagent.all_reduce import TensorParallelGroups
from nodeagent.rpc import serve


class TensorParallelServicer(tensor_parallel_pb2_grpc.TensorParallelServiceServicer):
    def __init__(self, groups: TensorParallelGroups) -> None:
        self._groups = groups

    def PushPartial(
        self, request: tensor_parallel_pb2.PushPartialRequest, context: grpc.ServicerContext
    ) -> tensor_parallel_pb2.PushPartialReply:
        def push() -> tensor_parallel_pb2.PushPartialReply:
            self._groups.resolve(request.target).accept(request)
            return tensor_parallel_pb2.PushPartialReply()

        return serve(context, "PushPartial", push)
