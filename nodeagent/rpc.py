"""The agent's gRPC plumbing, in one place: errors that know their status code, how a servicer method
turns any failure into a status (nothing a client sends can stop the server), and deadlines. (Channels and
their options: arceus.wire.channels.)"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)
R = TypeVar("R")
# A call without a deadline (ours always set one) reports as "infinite"; its waits still end at this.
MAX_CALL_SECONDS = 3600.0
REPLY_MARGIN_SECONDS = 1.0


class RpcFailure(Exception):
    """An error that already knows which gRPC status code it maps to."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def neighbour_failure_code(code: grpc.StatusCode | None) -> grpc.StatusCode:
    """The code a stage reports when a push to its neighbour failed with `code`.

    Reachability and time keep their meaning; a neighbour that does not host the stage (any more), or no
    longer accepts this generation's credential, means this stage's view of the pipeline is stale; anything
    else the neighbour rejected is our bug.
    """
    if code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    ):
        return code
    if code in (
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    ):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


def neighbour_failure(exc: grpc.RpcError, what: str) -> RpcFailure:
    """What a stage raises when `what` (a push to a neighbour) failed with `exc`: its code as
    `neighbour_failure_code` maps it, the message "<what> failed: <code>: <details>"."""
    return RpcFailure(neighbour_failure_code(exc.code()), f"{what} failed: {exc.code().name}: {exc.details()}")


def call_deadline(context: grpc.ServicerContext) -> float:
    """When the agent stops waiting within a call, as a time.monotonic() value: a quarter of the call's time (at most
    a second) before its deadline, so that the answer saying what it waited for reaches the caller before the
    caller's own deadline does, on a busy machine too (a bare DEADLINE_EXCEEDED names nothing)."""
    remaining = min(context.time_remaining(), MAX_CALL_SECONDS)
    return time.monotonic() + remaining - min(REPLY_MARGIN_SECONDS, remaining / 4)


def serve(context: grpc.ServicerContext, method: str, handler: Callable[[], R]) -> R:  # type: ignore[return]
    """Run a servicer method's `handler`; an RpcFailure leaves as its status, anything else as INTERNAL
    (and is logged: a bug)."""
    try:
        return handler()
    except RpcFailure as failure:
        code, message = failure.code, failure.message
        log.warning("%s -> %s: %s", method, code.name, message)
    except Exception as exc:
        # The traceback as text: a record holding the exception would hold the handler's frames, and so the stage
        # they serve, in any handler that keeps records (pytest's): that stage's drop would wait its whole grace.
        log.error("%s failed unexpectedly\n%s", method, traceback.format_exc())
        code, message = grpc.StatusCode.INTERNAL, f"{method} failed unexpectedly: {type(exc).__name__}: {exc}"
    context.abort(code, message)  # raises: the status goes to the caller
