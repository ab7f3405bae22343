"""CallLimits decides from a call's metadata before its message is read, and caps how long any call runs, whatever
deadline its caller set: the servicer's time_remaining() says so, a stream held open past the cap is cancelled, and
so is a call whose first message does not come in time (a real gRPC server, with methods of its own whose cap is a
second)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from arceus.contracts.credentials import Role, StageCredentials, token_digest
from arceus.v1 import link_probe_pb2, replica_pb2, stage_pb2, tensor_parallel_pb2
from arceus.wire.channels import open_channel
from arceus.wire.tls import new_identity
from nodeagent import call_limits
from nodeagent.call_limits import WAITING_PER_CALLER, CallLimits, MethodLimits
from nodeagent.callers import METHOD_ROLES, Guard

TOKEN = "a" * 64
SERVICE = "test.Limited"
Server = tuple[str, str, list[float]]  # address, certificate, what the servicer saw
CAP = 1.0
WORKERS = 32


FIRST_MESSAGE = 0.5


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    for name, limits in (("Remaining", MethodLimits(CAP, 1024)), ("Hold", MethodLimits(CAP, 1024)),
                         ("Wait", MethodLimits(30.0, 1024, FIRST_MESSAGE)), ("Peers", MethodLimits(CAP, 1024)),
                         ("Idle", MethodLimits(30.0, 1024, 30.0))):
        monkeypatch.setitem(call_limits.LIMITS, f"/{SERVICE}/{name}", limits)
        monkeypatch.setitem(METHOD_ROLES, f"/{SERVICE}/{name}",
                            frozenset({Role.PEER}) if name == "Peers" else frozenset({Role.DRIVER}))
    seen: list[float] = []

    def remaining(_request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(context.time_remaining())
        return b""

    def hold(requests: Iterator[bytes], _context: grpc.ServicerContext) -> bytes:
        for _ in requests:  # ends when the caller half-closes, or when the call is cancelled
            pass
        return b""

    credentials = StageCredentials(token=TOKEN, accepts={Role.DRIVER: (token_digest(TOKEN),)})
    limits = CallLimits(lambda: [Guard("job", 0, 1, credentials, {}, 1)], max_workers=WORKERS)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS), interceptors=[limits])
    grpc_server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Remaining": grpc.unary_unary_rpc_method_handler(remaining),
        "Hold": grpc.stream_unary_rpc_method_handler(hold),
        "Wait": grpc.unary_unary_rpc_method_handler(remaining),
        "Peers": grpc.unary_unary_rpc_method_handler(remaining),
        "Idle": grpc.stream_unary_rpc_method_handler(hold),
    })])
    identity = new_identity()
    port = grpc_server.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(identity.key_pem, identity.certificate_pem)])
    )
    grpc_server.start()
    try:
        yield f"127.0.0.1:{port}", identity.certificate, seen
    finally:
        grpc_server.stop(None)
        limits.stop()


def test_a_servicer_sees_at_most_its_methods_cap_whatever_the_caller_asked(server: Server) -> None:
    address, certificate, seen = server
    with open_channel(address, token=TOKEN, certificate=certificate) as channel:
        channel.unary_unary(f"/{SERVICE}/Remaining")(b"", timeout=3600)
    assert len(seen) == 1 and 0 < seen[0] <= CAP


def test_a_stream_held_open_past_its_cap_is_cancelled(server: Server) -> None:
    address, certificate, _ = server
    never = threading.Event()

    def idle() -> Iterator[bytes]:
        never.wait(30)
        yield b""

    with open_channel(address, token=TOKEN, certificate=certificate) as channel:
        call = channel.stream_unary(f"/{SERVICE}/Hold").future(idle(), timeout=3600)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=CAP + 10)  # the watchdog looks once a second
        assert info.value.code() == grpc.StatusCode.CANCELLED
    never.set()


def test_an_unknown_token_is_refused_before_any_message_is_read(server: Server) -> None:
    address, certificate, _ = server
    with open_channel(address, token="b" * 64, certificate=certificate) as channel:
        call = channel.stream_unary(f"/{SERVICE}/Hold").future(iter(()), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_call_whose_message_does_not_come_in_time_is_cancelled(server: Server) -> None:
    """Its headers alone hold a worker only so long: the method's first-message time, not its cap."""
    address, certificate, seen = server
    release = threading.Event()

    def nothing() -> Iterator[bytes]:
        release.wait(30)
        return
        yield

    with open_channel(address, token=TOKEN, certificate=certificate) as channel:
        started = time.monotonic()
        call = channel.stream_unary(f"/{SERVICE}/Wait").future(nothing(), timeout=3600)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=10)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - started < FIRST_MESSAGE + 1.0
        channel.unary_unary(f"/{SERVICE}/Wait")(b"", timeout=10)  # one that sends its message is served
    release.set()
    assert len(seen) == 1


def test_a_callers_oldest_waiting_call_makes_way_for_its_newer_ones(server: Server) -> None:
    address, certificate, seen = server
    release = threading.Event()

    def nothing() -> Iterator[bytes]:
        release.wait(30)
        return
        yield

    with open_channel(address, token=TOKEN, certificate=certificate) as channel:
        waiting = [channel.stream_unary(f"/{SERVICE}/Idle").future(nothing(), timeout=3600)
                   for _ in range(WAITING_PER_CALLER)]
        time.sleep(0.3)  # all waiting (the server takes calls in order)
        assert not any(c.done() for c in waiting)
        channel.unary_unary(f"/{SERVICE}/Remaining")(b"", timeout=10)  # served
        deadline = time.monotonic() + 10
        while not any(c.done() for c in waiting):
            assert time.monotonic() < deadline, "no waiting call made way"
            time.sleep(0.02)
        time.sleep(0.3)
        # One of them (the first the server took) gave way; the rest wait on.
        [gave_way] = [c for c in waiting if c.done()]
        assert gave_way.code() == grpc.StatusCode.CANCELLED
        release.set()
    assert len(seen) == 1


def test_a_method_none_of_the_callers_roles_may_call_is_refused_unread(server: Server) -> None:
    address, certificate, seen = server
    with open_channel(address, token=TOKEN, certificate=certificate) as channel:
        call = channel.stream_unary(f"/{SERVICE}/Peers").future(iter(()), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == "the call's credential does not allow Peers on the stage it addresses"
    assert seen == []


def test_a_method_without_limits_is_not_served(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    address, certificate, _ = server
    monkeypatch.delitem(call_limits.LIMITS, f"/{SERVICE}/Remaining")
    with open_channel(address, token=TOKEN, certificate=certificate) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"/{SERVICE}/Remaining")(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_every_method_the_agent_serves_has_limits() -> None:
    served = {
        f"/{service.full_name}/{method.name}"
        for module in (stage_pb2, tensor_parallel_pb2, link_probe_pb2, replica_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert served == set(call_limits.LIMITS) == set(METHOD_ROLES)
