"""What any caller can make this agent spend: threads, time and bytes, bounded before a servicer runs.

Every call passes through `CallLimits`, a server interceptor, before it gets one of the server's worker threads:
- A call whose token no hosted stage accepts is refused there (UNAUTHENTICATED, the words of
  `nodeagent.callers`) by a handler that reads none of its messages, so an idle stream from a stranger holds
  nothing.
- A known caller (one token digest) may hold at most `CALLS_PER_CALLER` calls at once, `STREAMS_PER_CALLER` of
  them sending streams, and all callers together the worker threads but `HEALTH_RESERVE`: the health check
  always finds a thread (RESOURCE_EXHAUSTED beyond, naming the bound).
- A method's call runs at most its `MethodLimits.seconds`, whatever deadline its caller set: the servicer sees
  a `time_remaining()` capped to that, and a watchdog cancels a call (a stream held open) that outlives it.
- A unary request larger than its method's `request_bytes` is refused unparsed (RESOURCE_EXHAUSTED); a
  streaming method's messages are bounded by the server's own limit and checked by the servicer. Bytes that
  are no message of the method's type are INVALID_ARGUMENT.
The health service's `Check` is always served; its `Watch`, a stream per watcher, is not.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from arceus.wire.push_stream import STREAM_SECONDS
from nodeagent.callers import NOT_AUTHENTICATED, Guard, metadata_digest
from nodeagent.link_probe import MAX_PROBE_BYTES
from nodeagent.rpc import RpcFailure

log = logging.getLogger(__name__)

CALLS_PER_CALLER = 16
STREAMS_PER_CALLER = 8
# Worker threads no data-plane call may take: the health check's.
HEALTH_RESERVE = 4
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
_WATCHDOG_SECONDS = 1.0
_KiB = 1024
_SMALL = 64 * _KiB  # a request that names a stage and a step, nothing more


@dataclass(frozen=True)
class MethodLimits:
    seconds: float  # the longest a call may run
    request_bytes: int | None = None  # the largest unary request; None: the server's message limit


_STAGE, _TP, _PROBE = "/arceus.v1.StageService/", "/arceus.v1.TensorParallelService/", "/arceus.v1.LinkProbeService/"
# Generous to honest callers (the driver's own timeouts are shorter), finite for everyone.
LIMITS: dict[str, MethodLimits] = {
    _STAGE + "PushTensor": MethodLimits(600.0),
    _STAGE + "PushStream": MethodLimits(STREAM_SECONDS + 60.0),  # a sender keeps one open for its lifetime
    _STAGE + "RunStep": MethodLimits(1800.0, _SMALL),
    _STAGE + "GetState": MethodLimits(3600.0, _SMALL),  # a large stage's state over a slow uplink
    _STAGE + "SaveState": MethodLimits(3600.0, _SMALL),
    _STAGE + "Audit": MethodLimits(600.0, _SMALL),
    _STAGE + "AuditWeights": MethodLimits(3600.0, _SMALL),
    _STAGE + "VerifyForward": MethodLimits(1800.0),
    _STAGE + "Infer": MethodLimits(600.0),
    _TP + "PushPartial": MethodLimits(600.0),
    _PROBE + "Probe": MethodLimits(60.0, MAX_PROBE_BYTES + _KiB),
}


@dataclass(frozen=True)
class _Unparsed:
    """A request refused before it was parsed: too big, or bytes that are no such message."""

    code: grpc.StatusCode
    message: str


@dataclass
class _Call:
    caller: str
    streaming: bool
    expires: float  # time.monotonic()
    context: grpc.ServicerContext


class _CappedContext:
    """The servicer's view of its call: the real context, with `time_remaining()` no later than the cap."""

    def __init__(self, context: grpc.ServicerContext, expires: float) -> None:
        self._context = context
        self._expires = expires

    def time_remaining(self) -> float:
        return min(self._context.time_remaining(), max(0.0, self._expires - time.monotonic()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class CallLimits(grpc.ServerInterceptor):
    """Bounds every call to a server with `max_workers` worker threads; `guards` says whose tokens are known."""

    def __init__(self, guards: Callable[[], Iterable[Guard]], *, max_workers: int) -> None:
        if max_workers <= HEALTH_RESERVE:
            raise ValueError(f"max_workers must exceed the {HEALTH_RESERVE} threads kept for the health check")
        self._guards = guards
        self._max_calls = max_workers - HEALTH_RESERVE
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="call-limits", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        self._stopped.set()
        self._watchdog.join()

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        # Runs on the server's polling thread, before any worker is taken: nothing here may block.
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method == HEALTH_CHECK:
            return handler
        if method == HEALTH_WATCH:
            return _refusal(handler, grpc.StatusCode.UNIMPLEMENTED, "Watch is not served here: poll Check")
        limits = LIMITS.get(method)
        if limits is None:  # a method added without limits is a bug, and is not served
            log.error("%s has no call limits (nodeagent.call_limits.LIMITS); refused", method)
            return _refusal(handler, grpc.StatusCode.UNIMPLEMENTED, f"{method} is not served")
        caller = metadata_digest(handler_call_details.invocation_metadata)
        if caller is None or not any(guard.credentials.roles_of(caller) for guard in self._guards()):
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, NOT_AUTHENTICATED)
        return self._bounded(handler, method, caller, limits)

    def _bounded(
        self, handler: grpc.RpcMethodHandler, method: str, caller: str, limits: MethodLimits
    ) -> grpc.RpcMethodHandler:
        streaming = handler.request_streaming
        name = method.rsplit("/", 1)[-1]

        def admitted(request: Any, context: grpc.ServicerContext) -> tuple[int, Any, Any]:
            if isinstance(request, _Unparsed):
                log.warning("%s -> %s: %s", name, request.code.name, request.message)
                context.abort(request.code, request.message)
            call_id, expires = self._admit(caller, streaming, limits, context, name)
            return call_id, _parsed_only(request) if streaming else request, _CappedContext(context, expires)

        def unary_response(request: Any, context: grpc.ServicerContext) -> Any:
            call_id, request, capped = admitted(request, context)
            try:
                return behaviour(request, capped)
            finally:
                self._release(call_id)

        def stream_response(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            call_id, request, capped = admitted(request, context)
            try:
                yield from behaviour(request, capped)
            finally:
                self._release(call_id)

        behaviour = _behaviour(handler)
        parse = _checked_parse(handler.request_deserializer, None if streaming else limits.request_bytes, name)
        return _handler_like(handler, stream_response if handler.response_streaming else unary_response, parse)

    def _admit(
        self, caller: str, streaming: bool, limits: MethodLimits, context: grpc.ServicerContext, name: str
    ) -> tuple[int, float]:
        """Count the call in, or refuse it; returns its id and when it must end."""
        with self._lock:
            mine = [c for c in self._calls.values() if c.caller == caller]
            if len(self._calls) >= self._max_calls:
                refusal = f"this agent is serving its most calls ({self._max_calls}); retry later"
            elif len(mine) >= CALLS_PER_CALLER:
                refusal = f"this caller already has {CALLS_PER_CALLER} calls open on this agent, the most it may"
            elif streaming and sum(c.streaming for c in mine) >= STREAMS_PER_CALLER:
                refusal = f"this caller already has {STREAMS_PER_CALLER} streams open on this agent, the most it may"
            else:
                call_id, expires = next(self._ids), time.monotonic() + limits.seconds
                self._calls[call_id] = _Call(caller, streaming, expires, context)
                return call_id, expires
        log.warning("%s -> RESOURCE_EXHAUSTED: %s", name, refusal)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        raise AssertionError("unreachable: abort raises")

    def _release(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def _watch(self) -> None:
        while not self._stopped.wait(_WATCHDOG_SECONDS):
            now = time.monotonic()
            with self._lock:
                overdue = [c for c in self._calls.values() if c.expires <= now]
            for call in overdue:  # a stream's reader wakes and ends; the call's release follows
                call.context.cancel()


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def _handler_like(
    handler: grpc.RpcMethodHandler, behaviour: Callable[..., Any], deserializer: Callable[[bytes], Any] | None
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape (streaming both ways as it is) running `behaviour`."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(behaviour, request_deserializer=deserializer, response_serializer=handler.response_serializer)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that refuses at once: it parses no request and reads no stream."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    def refuse_streaming(_request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort(code, message)
        yield  # a generator, as a response stream's behaviour must be

    return _handler_like(handler, refuse_streaming if handler.response_streaming else refuse, None)


def _checked_parse(parse: Callable[[bytes], Any] | None, limit: int | None, name: str) -> Callable[[bytes], Any]:
    """`parse`, refusing a request over `limit` bytes unread and one that is no message (gRPC itself would answer
    those INTERNAL, and log a traceback)."""

    def checked(data: bytes) -> Any:
        if limit is not None and len(data) > limit:
            return _Unparsed(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"a {name} request may be at most {limit:,} bytes; this one has "
                f"{len(data):,}"
            )
        try:
            return parse(data) if parse is not None else data
        except DecodeError:
            return _Unparsed(grpc.StatusCode.INVALID_ARGUMENT, f"the bytes sent are not a {name} request message")

    return checked


def _parsed_only(requests: Iterator[Any]) -> Iterator[Any]:
    """A request stream whose unparsable message ends the call with its status (the servicer's `serve` turns
    the RpcFailure into it)."""
    for request in requests:
        if isinstance(request, _Unparsed):
            raise RpcFailure(request.code, request.message)
        yield request
