"""What any caller can make this agent spend: threads, time and bytes, bounded before a servicer runs.

gRPC's sync server takes a worker thread for every call it hands on, and for a unary method that thread waits
for the whole request message before any application code runs. So every decision here is made in `CallLimits`,
a server interceptor, on the server's polling thread, from the call's metadata alone, before any message is read
and before a worker is taken, and every handler it hands on takes the request as a stream (a unary call's one
message is read by the handler itself, under a deadline):
- A call whose token no hosted stage accepts (or that presents none) gets a handler that refuses it at once
  (UNAUTHENTICATED, the words of `nodeagent.callers`) and reads none of its messages: a stranger holds a worker
  for the moment the refusal takes, and nothing it sent beyond gRPC's flow-control window is received, however
  large its message. So does a known caller's call of a method none of its roles may call (PERMISSION_DENIED,
  `nodeagent.callers.METHOD_ROLES`).
- A known caller (one token digest) may hold at most `CALLS_PER_CALLER` calls at once, `STREAMS_PER_CALLER` of
  them sending streams, and all callers together the worker threads but `HEALTH_RESERVE`: the health check and
  the refusals always find a thread (RESOURCE_EXHAUSTED beyond, naming the bound).
- A call waits for its first request message at most its method's `first_message_seconds` (cancelled after),
  and a caller has at most `WAITING_PER_CALLER` calls waiting so: a newer one makes its oldest waiting one give
  way (cancelled), so calls stalled after their headers never keep the caller's own working calls out.
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

from arceus.contracts.step_window import MAX_WINDOW_STEPS
from arceus.data.config import MAX_BATCH_SIZE
from arceus.wire.push_stream import STREAM_SECONDS
from nodeagent.callers import METHOD_ROLES, NOT_AUTHENTICATED, Guard, caller_roles, metadata_digest, not_allowed
from nodeagent.link_probe import MAX_PROBE_BYTES
from nodeagent.rpc import RpcFailure

log = logging.getLogger(__name__)

CALLS_PER_CALLER = 16
STREAMS_PER_CALLER = 8
WAITING_PER_CALLER = 8
# Worker threads no data-plane call may take: the health check's (and the refusals').
HEALTH_RESERVE = 4
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
_WATCHDOG_SECONDS = 0.25
_KiB = 1024
_SMALL = 64 * _KiB  # a request that names a stage and a step, nothing more
# A RunStep may also name its batch's samples (StepData): up to MAX_BATCH_SIZE indices of at most 10 bytes each.
_RUN_STEP = _SMALL + 10 * MAX_BATCH_SIZE
FIRST_MESSAGE_SECONDS = 5.0  # for a small request to arrive
# For a first message that carries a tensor (at most the server's message limit, 256 MiB: 4.5 MB/s).
TENSOR_FIRST_MESSAGE_SECONDS = 60.0


@dataclass(frozen=True)
class MethodLimits:
    seconds: float  # the longest a call may run
    request_bytes: int | None = None  # the largest unary request; None: the server's message limit
    first_message_seconds: float = FIRST_MESSAGE_SECONDS  # the longest its first request message may take


_STAGE, _TP, _PROBE = "/arceus.v1.StageService/", "/arceus.v1.TensorParallelService/", "/arceus.v1.LinkProbeService/"
_REPLICA = "/arceus.v1.ReplicaService/"
_TENSOR = TENSOR_FIRST_MESSAGE_SECONDS
# Generous to honest callers (the driver's own timeouts are shorter), finite for everyone.
LIMITS: dict[str, MethodLimits] = {
    _STAGE + "PushTensor": MethodLimits(600.0, first_message_seconds=_TENSOR),
    # A sender keeps one open for its lifetime.
    _STAGE + "PushStream": MethodLimits(STREAM_SECONDS + 60.0, first_message_seconds=_TENSOR),
    _STAGE + "RunStep": MethodLimits(1800.0, _RUN_STEP),
    _STAGE + "RunSteps": MethodLimits(3600.0, _RUN_STEP * MAX_WINDOW_STEPS),
    _STAGE + "NeighbourStreamPort": MethodLimits(60.0, _SMALL),
    _STAGE + "GetState": MethodLimits(3600.0, _SMALL),  # a large stage's state over a slow uplink
    _STAGE + "SaveState": MethodLimits(3600.0, _SMALL),
    _STAGE + "Audit": MethodLimits(600.0, _SMALL),
    _STAGE + "AuditWeights": MethodLimits(3600.0, _SMALL),
    _STAGE + "VerifyForward": MethodLimits(1800.0, first_message_seconds=_TENSOR),
    _STAGE + "Infer": MethodLimits(600.0, first_message_seconds=_TENSOR),
    _STAGE + "AuditPartial": MethodLimits(3600.0, _SMALL),  # a large stage's gradient over a slow uplink
    _STAGE + "VerifyPartial": MethodLimits(1800.0, first_message_seconds=_TENSOR),
    _TP + "PushPartial": MethodLimits(600.0, first_message_seconds=_TENSOR),
    _REPLICA + "ExchangePort": MethodLimits(60.0, _SMALL),
    _REPLICA + "Snapshot": MethodLimits(3600.0, _SMALL),  # a large stage's state over a slow uplink
    _REPLICA + "CopyState": MethodLimits(3600.0, _SMALL),
    _REPLICA + "Holdings": MethodLimits(600.0, _SMALL),
    _PROBE + "Probe": MethodLimits(60.0, MAX_PROBE_BYTES + _KiB, first_message_seconds=30.0),
}


@dataclass(frozen=True)
class _Unparsed:
    """A request refused before it was parsed: too big, or bytes that are no such message."""

    code: grpc.StatusCode
    message: str


@dataclass(eq=False)
class _Call:
    """An admitted call, from its admission on the polling thread until its worker lets it go."""

    order: int  # admissions counted: a caller's oldest waiting call makes way first
    caller: str
    streaming: bool
    limits: MethodLimits
    ends: float  # time.monotonic() by which it must be over
    expires: float  # when the watchdog cancels it: its first message's deadline while it waits, then `ends`
    waiting: bool = True  # no request message has arrived yet
    context: grpc.ServicerContext | None = None  # once a worker runs it
    made_way: bool = False  # cancelled for its caller's newer call; no longer counted
    cancelled: bool = False


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
        self._calls: set[_Call] = set()
        self._admissions = itertools.count()
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="call-limits", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
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
        roles = caller_roles(caller, self._guards())
        if caller is None or not roles:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, NOT_AUTHENTICATED)
        if roles.isdisjoint(METHOD_ROLES.get(method, ())):
            name = method.rsplit("/", 1)[-1]
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, not_allowed(name), logged=method)
        call = self._admit(caller, handler.request_streaming, limits)
        if isinstance(call, str):
            return _refusal(handler, grpc.StatusCode.RESOURCE_EXHAUSTED, call, logged=method)
        return self._bounded(handler, method, call)

    def _admit(self, caller: str, streaming: bool, limits: MethodLimits) -> _Call | str:
        """Count the call in (its caller's oldest waiting calls making way if need be), or say why not."""
        with self._lock:
            while True:
                live = [c for c in self._calls if not c.made_way]
                mine = [c for c in live if c.caller == caller]
                streams = [c for c in mine if c.streaming]
                if len(live) >= self._max_calls:
                    bound, held = f"this agent is serving its most calls ({self._max_calls}); retry later", mine
                elif len(mine) >= CALLS_PER_CALLER:
                    bound = f"this caller already has {CALLS_PER_CALLER} calls open on this agent, the most it may"
                    held = mine
                elif streaming and len(streams) >= STREAMS_PER_CALLER:
                    bound = f"this caller already has {STREAMS_PER_CALLER} streams open on this agent, the most it may"
                    held = streams
                elif sum(c.waiting for c in mine) >= WAITING_PER_CALLER:
                    bound, held = "", mine  # always one to make way
                else:
                    now = time.monotonic()
                    call = _Call(next(self._admissions), caller, streaming, limits, now + limits.seconds,
                                 now + limits.first_message_seconds)
                    self._calls.add(call)
                    return call
                waiting = [c for c in held if c.waiting]
                if not waiting:
                    return bound
                oldest = min(waiting, key=lambda c: c.order)
                oldest.made_way = True
                oldest.expires = 0.0
                self._wake.set()

    def _bounded(self, handler: grpc.RpcMethodHandler, method: str, call: _Call) -> grpc.RpcMethodHandler:
        """A request-streaming handler running `handler`'s behaviour within `call`'s limits."""
        name = method.rsplit("/", 1)[-1]
        unary = not handler.request_streaming
        behaviour = _behaviour(handler)

        def opened(requests: Iterator[Any], context: grpc.ServicerContext) -> tuple[Any, Any]:
            """The request (a unary method's one message, or the stream) and the servicer's context."""
            self._started(call, context, name)
            first = next(requests, None)  # a cancelled call raises its RpcError here, which ends it quietly
            with self._lock:
                call.waiting, made_way = False, call.made_way
                if not made_way:
                    call.expires = call.ends
            if made_way:  # its message came just as a newer call took its place
                _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, _MADE_WAY, name)
            if unary and first is None:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"a {name} call sends one request message", name)
            if unary and isinstance(first, _Unparsed):
                _abort(context, first.code, first.message, name)
            capped = _CappedContext(context, call.ends)
            if unary:
                return first, capped
            return _parsed_only(itertools.chain(() if first is None else (first,), requests)), capped

        def unary_response(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            try:
                request, capped = opened(requests, context)
                return behaviour(request, capped)
            finally:
                self._release(call)

        def stream_response(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                request, capped = opened(requests, context)
                yield from behaviour(request, capped)
            finally:
                self._release(call)

        parse = _checked_parse(handler.request_deserializer, call.limits.request_bytes if unary else None, name)
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream_response, parse, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(unary_response, parse, handler.response_serializer)

    def _started(self, call: _Call, context: grpc.ServicerContext, name: str) -> None:
        """A worker runs `call` now: its first message's time starts (a call that queued for a worker did not
        stall), unless it already made way for a newer one."""
        with self._lock:
            call.context, made_way = context, call.made_way
            if not made_way:
                call.expires = min(call.ends, time.monotonic() + call.limits.first_message_seconds)
        if made_way:
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, _MADE_WAY, name)

    def _release(self, call: _Call) -> None:
        with self._lock:
            self._calls.discard(call)

    def _watch(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(_WATCHDOG_SECONDS)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [c for c in self._calls if c.expires <= now and c.context is not None and not c.cancelled]
                for call in due:
                    call.cancelled = True
            stalled = sum(c.waiting and not c.made_way for c in due)
            if stalled:
                log.warning("cancelled %d call(s) that sent no request message in time", stalled)
            for call in due:  # a waiting or streaming reader wakes and ends; the call's release follows
                assert call.context is not None
                call.context.cancel()


_MADE_WAY = (
    f"this caller had {WAITING_PER_CALLER} calls waiting for their first message on this agent, the most it may: "
    "its oldest made way for a newer one"
)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str, name: str) -> None:
    log.warning("%s -> %s: %s", name, code.name, message)
    context.abort(code, message)


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def _refusal(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str, *, logged: str | None = None
) -> grpc.RpcMethodHandler:
    """A handler that refuses at once and reads nothing, whatever `handler`'s shape: one that takes its request
    as a stream is run before any message arrives (a unary one would wait for its whole message first)."""

    def refuse(_requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        if logged is not None:
            log.warning("%s -> %s: %s", logged.rsplit("/", 1)[-1], code.name, message)
        context.abort(code, message)

    def refuse_streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        refuse(requests, context)
        yield  # a generator, as a response stream's behaviour must be

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_streaming, None, handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(refuse, None, handler.response_serializer)


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
