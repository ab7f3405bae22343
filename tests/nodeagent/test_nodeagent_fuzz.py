"""A gRPC fuzzer against every method of a live agent: hypothesis builds requests from the protos' own
descriptors (any field, any value, nested messages, huge shapes and counts), mangles their wire bytes, or sends
bytes that are no message at all, as the job's driver and as its neighbour stage (a stranger is refused before
anything is parsed: test_nodeagent_strangers). Every call ends with a status that names a refusal, never
INTERNAL or UNKNOWN (an unexpected exception: a bug); the agent answers its health check after each one, never
logs a traceback, and its memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.v1 import link_probe_pb2, stage_pb2, tensor_parallel_pb2
from arceus.wire.channels import open_channel
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, pipeline_assignments, rank_credentials

pytestmark = pytest.mark.slow

JOB = "fuzz-job"
MODEL = {"layer_sizes": [64, 32, 10]}
MICRO_BATCHES = 2
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
# Refusals the agent may answer with; a deadline is a refusal too (a step waits for inputs that never come).
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
}
CALL_SECONDS = 3.0
MEMORY_GROWTH_KIB = 256 * 1024


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    [address] = [f"127.0.0.1:{p}" for p in free_ports(1)]
    assignments = pipeline_assignments(
        job_id=JOB, model_config=MODEL, boundaries=[0, 1, 2], addresses=[address, address],
        optimizer={"name": "adam", "lr": 0.01}, seed=0, micro_batches=MICRO_BATCHES,
        max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
    )
    [started] = spawn_static_agents([assignments], [address], tmp_path_factory.mktemp("fuzz-agent"))
    try:
        yield started
    finally:
        assert stop_agents([started]) == [0]
    log = started.log_text()
    assert "Traceback" not in log and "failed unexpectedly" not in log


def _methods() -> list[tuple[str, Descriptor, bool, bool]]:
    """Every method the agent serves: its path, request type, and whether requests and replies stream."""
    return [
        (f"/{service.full_name}/{method.name}", method.input_type, method.client_streaming, method.server_streaming)
        for module in (stage_pb2, tensor_parallel_pb2, link_probe_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


METHODS = _methods()
_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
}
# Small and edge values more often than uniform ones: they reach further into the checks.
_EDGES = (0, 1, -1, 2, 3, 7, 8, 64, 2**31 - 1, 2**40)


def values(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    if field.type in _RANGES:
        low, high = _RANGES[field.type]
        return st.one_of(st.sampled_from([v for v in _EDGES if low <= v <= high]), st.integers(low, high))
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 100))
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(width=32 if field.type == FieldDescriptor.TYPE_FLOAT else 64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        dtypes = st.sampled_from(["float32", "int64", "bfloat16", "float16", "int8", "uint8", "fp32", ""])
        return st.one_of(dtypes, st.text(max_size=40), st.just(JOB))
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=2048)
    raise AssertionError(f"no strategy for {field.full_name} of type {field.type}")


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    fields: dict[str, st.SearchStrategy] = {}
    for field in descriptor.fields:
        one = values(field, depth)
        fields[field.name] = st.lists(one, max_size=6) if field.is_repeated else one
    if descriptor.full_name == "arceus.v1.StageRef":  # mostly the stages hosted here: past the lookups
        hosted = st.builds(lambda i, g: cls(job_id=JOB, stage_index=i, generation=g), st.sampled_from([0, 1, 2, -1]),
                           st.sampled_from([1, 1, 1, 0, 2]))
        return st.one_of(hosted, hosted, st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw)))
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def wire(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """A request's bytes: a generated message as it is, cut short, with bytes flipped, or bytes of anything."""
    whole = messages(descriptor).map(lambda m: m.SerializeToString())

    def cut(data: bytes, at: int) -> bytes:
        return data[: at % (len(data) + 1)]

    def flip(data: bytes, at: int, value: int) -> bytes:
        if not data:
            return bytes([value])
        i = at % len(data)
        return data[:i] + bytes([value]) + data[i + 1 :]

    return st.one_of(
        whole, whole, whole,
        st.builds(cut, whole, st.integers(0, 4096)),
        st.builds(flip, whole, st.integers(0, 4096), st.integers(0, 255)),
        st.binary(max_size=512),
    )


@pytest.fixture(scope="module")
def callers(agent: AgentProcess) -> Iterator[dict[str, grpc.Channel]]:
    channels = {
        "driver": open_channel(agent.grpc_address, token=driver_token(JOB), certificate=agent.certificate),
        "neighbour": open_channel(agent.grpc_address, token=rank_credentials(JOB, 1, 1, 0, [1, 1]).token,
                                  certificate=agent.certificate),
    }
    yield channels
    for channel in channels.values():
        channel.close()


@pytest.fixture(scope="module")
def health(callers: dict[str, grpc.Channel]) -> Callable[[], None]:
    stub = health_pb2_grpc.HealthStub(callers["driver"])

    def check() -> None:
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING

    return check


def call(channel: grpc.Channel, method: str, streams: tuple[bool, bool], requests: list[bytes]) -> grpc.StatusCode:
    """Send raw request bytes; the call's final status (OK: a reply, or a reply stream read to its end)."""
    open_call = {
        (False, False): channel.unary_unary, (False, True): channel.unary_stream,
        (True, False): channel.stream_unary, (True, True): channel.stream_stream,
    }[streams]
    try:
        reply = open_call(method)(iter(requests) if streams[0] else requests[0], timeout=CALL_SECONDS)
        if streams[1]:
            for _ in reply:
                pass
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(("method", "request_type", "streaming", "replies_stream"), METHODS,
                         ids=[m.rsplit("/", 1)[-1] for m, *_ in METHODS])
def test_any_request_to_any_method_is_answered_or_refused(
    agent: AgentProcess, callers: dict[str, grpc.Channel], health: Callable[[], None],
    method: str, request_type: Descriptor, streaming: bool, replies_stream: bool,
) -> None:
    before = _rss_kib(agent)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(caller=st.sampled_from(sorted(callers)),
           requests=st.lists(wire(request_type), min_size=1, max_size=4 if streaming else 1))
    def fuzz(caller: str, requests: list[bytes]) -> None:
        code = call(callers[caller], method, (streaming, replies_stream), requests)
        assert code == grpc.StatusCode.OK or code in REFUSALS, (method, caller, code)
        health()

    fuzz()
    assert agent.process.poll() is None
    assert _rss_kib(agent) - before < MEMORY_GROWTH_KIB


def _rss_kib(agent: AgentProcess) -> int:
    for line in Path(f"/proc/{agent.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")
