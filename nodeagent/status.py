"""`RpcFailure`: an error that already knows which gRPC status code it maps to."""

from __future__ import annotations

import grpc


class RpcFailure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def neighbour_failure_code(code: grpc.StatusCode | None) -> grpc.StatusCode:
    """The code a stage reports when a push to its neighbour failed with `code`.

    Reachability and time keep their meaning; a neighbour that does not host the stage (any more) means
    this stage's view of the pipeline is stale; anything else the neighbour rejected is our bug.
    """
    if code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    ):
        return code
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL
