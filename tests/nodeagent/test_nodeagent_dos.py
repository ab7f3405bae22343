"""Denial of service against a real agent process: whatever strangers and known callers open, hold or send,
the agent answers its health check within a second and its job trains on afterwards.

One agent hosts both stages of a two-stage job; its stage 1 is the caller whose pushes stage 0 accepts
(gradients), so the test can also act as that known neighbour.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import requests
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arceus.checkpoint import decode_checkpoint
from arceus.contracts.assignment import max_micro_batch_size
from arceus.contracts.certificates import AGENT_TLS_NAME
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import TrainPlan
from arceus.training.recording import RecordingSink
from arceus.v1 import (
    link_probe_pb2,
    link_probe_pb2_grpc,
    replica_pb2,
    stage_pb2,
    stage_pb2_grpc,
    tensor_parallel_pb2,
)
from arceus.wire.channels import open_channel, pinned_channel_credentials
from arceus.wire.proto_tensor import to_proto
from arceus.wire.push_stream import raw_push, serialize
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, pipeline_assignments, rank_credentials, stage_endpoints
from nodeagent.call_limits import CALLS_PER_CALLER, LIMITS, STREAMS_PER_CALLER, WAITING_PER_CALLER
from nodeagent.callers import NOT_AUTHENTICATED

pytestmark = pytest.mark.slow

JOB = "dos-job"
MODEL = {"layer_sizes": [64, 32, 10]}
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MAX_MB = max_micro_batch_size(DATASET, 2)
HOUR = 3600.0


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    [address] = [f"127.0.0.1:{p}" for p in free_ports(1)]
    assignments = pipeline_assignments(
        job_id=JOB, model_config=MODEL, boundaries=[0, 1, 2], addresses=[address, address],
        optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=2, max_micro_batch_size=MAX_MB,
    )
    [started] = spawn_static_agents([assignments], [address], tmp_path_factory.mktemp("dos-agent"))
    try:
        yield started
    finally:
        assert stop_agents([started]) == [0]
    assert "Traceback" not in started.log_text()


@pytest.fixture(scope="module")
def health(agent: AgentProcess) -> Iterator[Callable[[], None]]:
    """Check the agent's health over an already open channel: SERVING within 1 s, or the test fails."""
    with grpc.secure_channel(agent.grpc_address, pinned_channel_credentials(agent.certificate),
                             options=[("grpc.ssl_target_name_override", AGENT_TLS_NAME)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected before anything is timed

        def check() -> None:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        yield check


def stranger_channel(agent: AgentProcess, *options: tuple[str, int]) -> grpc.Channel:
    """A TLS channel to the agent (its certificate is public) that presents no credential."""
    return grpc.secure_channel(agent.grpc_address, pinned_channel_credentials(agent.certificate),
                               options=[("grpc.ssl_target_name_override", AGENT_TLS_NAME), *options])


def stub_as(agent: AgentProcess, token: str) -> tuple[grpc.Channel, stage_pb2_grpc.StageServiceStub]:
    channel = open_channel(agent.grpc_address, token=token, certificate=agent.certificate)
    return channel, stage_pb2_grpc.StageServiceStub(channel)


def neighbour_token() -> str:
    """Stage 1's own token: stage 0 accepts its gradients."""
    return rank_credentials(JOB, 1, 1, 0, [1, 1]).token


def idle_streams(stub: stage_pb2_grpc.StageServiceStub, count: int, release: threading.Event) -> list[grpc.Future]:
    """`count` PushStreams that send nothing until `release`, each with an hour's deadline."""

    def nothing() -> Iterator[stage_pb2.PushTensorRequest]:
        release.wait()
        return
        yield  # a generator that sends no message

    return [stub.PushStream(nothing(), timeout=HOUR) for _ in range(count)]


def settle(calls: list[grpc.Future], refused: int, timeout: float = 20.0) -> list[grpc.Future]:
    """Wait until `refused` of `calls` have ended; return those still open."""
    deadline = time.monotonic() + timeout
    while sum(c.done() for c in calls) < refused and time.monotonic() < deadline:
        time.sleep(0.05)
    return [c for c in calls if not c.done()]


def test_a_strangers_idle_streams_hold_nothing(agent: AgentProcess, health: Callable[[], None]) -> None:
    """Once, 32 idle PushStreams from anyone took every server thread."""
    release = threading.Event()
    channel, stub = stub_as(agent, "0" * 64)
    try:
        calls = idle_streams(stub, 256, release)
        assert settle(calls, refused=256) == []
        assert {(c.code(), c.details()) for c in calls} == {(grpc.StatusCode.UNAUTHENTICATED, NOT_AUTHENTICATED)}
        health()
    finally:
        release.set()
        channel.close()


def test_a_known_caller_holds_at_most_its_share_of_streams(agent: AgentProcess, health: Callable[[], None]) -> None:
    """Streams that sent a message (one refused: the stream goes on) count against the caller's 8."""
    release = threading.Event()
    channel, stub = stub_as(agent, neighbour_token())
    wrong_shape = stage_pb2.PushTensorRequest(target=_ref(0), kind=stage_pb2.GRADIENT, step=10**6, micro_batch=0,
                                              tensor=to_proto(torch.zeros(1, 3)))

    def one_then_nothing() -> Iterator[stage_pb2.PushTensorRequest]:
        yield wrong_shape
        release.wait()

    try:
        streams = [stub.PushStream(one_then_nothing(), timeout=HOUR) for _ in range(STREAMS_PER_CALLER)]
        assert all(next(s).code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for s in streams)  # acked: open
        more = [stub.PushStream(one_then_nothing(), timeout=HOUR) for _ in range(4)]
        assert settle(streams + more, refused=4) == streams
        refused = more
        assert {s.code() for s in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert f"already has {STREAMS_PER_CALLER} streams open" in refused[0].details()
        health()
        # Another caller (the job's driver) is not held up by the neighbour's streams.
        driver_channel, driver = stub_as(agent, driver_token(JOB))
        with driver_channel:
            state = b"".join(c.data for c in driver.GetState(stage_pb2.GetStateRequest(target=_ref(0)), timeout=10))
            assert set(decode_checkpoint(state)) == {"layers.0.weight", "layers.0.bias"}
    finally:
        release.set()
        channel.close()


def test_a_known_callers_streams_that_send_nothing_make_way_for_its_newer_calls(
    agent: AgentProcess, health: Callable[[], None]
) -> None:
    release = threading.Event()
    channel, stub = stub_as(agent, neighbour_token())
    try:
        calls = idle_streams(stub, WAITING_PER_CALLER + 12, release)
        still_open = settle(calls, refused=12)
        assert len(still_open) == WAITING_PER_CALLER
        # Cancelled once a worker waited on it; refused if it never got one.
        assert {c.code() for c in calls if c.done()} <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        health()
        # Its own next call, one that sends its message, is served.
        probe = link_probe_pb2_grpc.LinkProbeServiceStub(channel).Probe
        assert probe(link_probe_pb2.ProbeRequest(reply_bytes=4), timeout=10).payload == bytes(4)
    finally:
        release.set()
        channel.close()


def test_a_flood_of_calls_leaves_the_health_check_answering(
    agent: AgentProcess, health: Callable[[], None]
) -> None:
    """Hundreds of concurrent calls, from a stranger and from the known neighbour (beyond its share), with an
    hour's deadline each: refused or answered, while the health check answers within a second."""
    stranger_channel, stranger = stub_as(agent, "f" * 64)
    neighbour_channel, neighbour = stub_as(agent, neighbour_token())
    step = stage_pb2.RunStepRequest(target=_ref(0), step=10**6, mode=stage_pb2.TRAIN, num_micro_batches=1,
                                    batch_size=2)
    calls = [stranger.RunStep.future(step, timeout=HOUR) for _ in range(200)]
    # A neighbour may not call RunStep at all: refused before its message is read.
    calls += [neighbour.RunStep.future(step, timeout=HOUR) for _ in range(2 * CALLS_PER_CALLER)]
    try:
        with ThreadPoolExecutor(4) as pool:
            for check in [pool.submit(health) for _ in range(8)]:
                check.result()
        codes = {c.exception(timeout=30).code() for c in calls}
        assert codes <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                         grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        health()
    finally:
        stranger_channel.close()
        neighbour_channel.close()


def test_an_oversized_request_is_refused_unread(agent: AgentProcess, health: Callable[[], None]) -> None:
    channel, stub = stub_as(agent, driver_token(JOB))
    with channel:
        huge = stage_pb2.RunStepRequest(target=stage_pb2.StageRef(job_id="x" * (8 << 20)), step=1)
        with pytest.raises(grpc.RpcError) as info:
            stub.RunStep(huge, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        bound = LIMITS["/arceus.v1.StageService/RunStep"].request_bytes
        assert bound is not None and bound < (8 << 20)  # a step's indices, never megabytes
        assert f"a RunStep request may be at most {bound:,} bytes" in info.value.details()
    health()


def test_the_health_watch_stream_is_not_served(agent: AgentProcess) -> None:
    """Each watcher would hold a server thread for as long as it likes."""
    with grpc.secure_channel(agent.grpc_address, pinned_channel_credentials(agent.certificate),
                             options=[("grpc.ssl_target_name_override", AGENT_TLS_NAME)]) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(watch)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_spot_check_of_a_huge_model_or_input_builds_nothing(
    agent: AgentProcess, health: Callable[[], None]
) -> None:
    """Once a 781-byte VerifyForward cost 1.5 GB; the agent's resident memory now stays where it was."""
    before = _rss_kib(agent)
    channel, stub = stub_as(agent, driver_token(JOB))
    huge_model = {"type": "transformer", "n_layer": 256, "d_model": 65536, "vocab_size": 10, "block_size": 8}
    requests = [
        stage_pb2.VerifyForwardRequest(model_config_json=json.dumps(huge_model), layer_start=0, layer_end=1,
                                       input=to_proto(torch.zeros(1, 8))),
        stage_pb2.VerifyForwardRequest(  # a header that claims a tensor of 4 GB
            model_config_json=json.dumps(MODEL), layer_start=0, layer_end=1,
            input=stage_pb2.Tensor(dtype="float32", shape=[1 << 24, 64], data=b"\0" * 1024)),
    ]
    with channel:
        for request in requests:
            with pytest.raises(grpc.RpcError) as info:
                stub.VerifyForward(iter([request]), timeout=10)
            assert info.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
    health()
    assert _rss_kib(agent) - before < 64 * 1024


def test_a_strangers_huge_message_is_refused_unread(agent: AgentProcess, health: Callable[[], None]) -> None:
    """Once a stranger's 250 MiB push was received whole before its refusal (the agent's peak grew by 780 MB)."""
    Path(f"/proc/{agent.process.pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    before = _memory_kib(agent)
    push = serialize(raw_push(_ref(0), stage_pb2.ACTIVATION, 1, 0, "float32", [250 << 18], bytes(250 << 20)))
    with stranger_channel(agent, ("grpc.max_send_message_length", -1)) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/arceus.v1.StageService/PushTensor")(push, timeout=60)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, NOT_AUTHENTICATED)
    health()
    after = _memory_kib(agent)
    assert after["VmHWM"] - before["VmRSS"] < 50 * 1024 and after["VmRSS"] - before["VmRSS"] < 50 * 1024, (
        before, after)


def test_an_unauthenticated_scrape_of_the_metrics_learns_no_job(agent: AgentProcess) -> None:
    """Once anyone could read the jobs an agent hosts from its /metrics (`arceus_stage_info{job_id=...}`)."""
    url = f"http://{agent.metrics_address}/metrics"
    for headers, params in (({}, {}), ({"Authorization": "Bearer " + "0" * 64}, {}), ({}, {"token": "guess"}),
                            ({"Authorization": f"Basic {agent.metrics_token}"}, {})):
        refused = requests.get(url, headers=headers, params=params, timeout=10)
        assert refused.status_code == 401 and JOB not in refused.text, (headers, params, refused.text)
        assert "scrape token" in refused.json()["detail"]
    # The holder of the agent's scrape token reads them, as a bearer token or as Prometheus sends it.
    token = agent.metrics_token
    for headers, params in (({"Authorization": f"Bearer {token}"}, {}), ({}, {"token": token})):
        scraped = requests.get(url, headers=headers, params=params, timeout=10)
        assert scraped.status_code == 200 and f'job_id="{JOB}"' in scraped.text


def every_method() -> list[tuple[str, bool]]:
    """Each method of each service the agent serves (the health check's aside): its path, and whether it answers
    with a stream."""
    return [
        (f"/{service.full_name}/{method.name}", method.server_streaming)
        for module in (stage_pb2, tensor_parallel_pb2, replica_pb2, link_probe_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def stalled_calls(channel: grpc.Channel, count: int, release: threading.Event) -> list[grpc.Future]:
    """`count` calls spread over every method, each sending its headers and then nothing until `release`."""

    def nothing() -> Iterator[bytes]:
        release.wait()
        return
        yield  # a generator that sends no message

    methods = every_method()
    calls: list[grpc.Future] = []
    for i in range(count):
        path, streaming = methods[i % len(methods)]
        call = channel.stream_stream(path) if streaming else channel.stream_unary(path)
        calls.append(call(nothing(), timeout=HOUR) if streaming else call.future(nothing(), timeout=HOUR))
    return calls


class StoppableSink(RecordingSink):
    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()

    def should_stop(self) -> bool:
        return self.stop.is_set()


def test_stalled_calls_on_every_method_leave_the_health_check_answering_and_the_job_training(
    agent: AgentProcess, health: Callable[[], None]
) -> None:
    """Once 64 calls that sent only their headers, from a stranger, took every server thread: the health check
    went silent and the job froze. Now a stranger's are refused at once, and a neighbour's (its credential is
    the job's) beyond the few it may have waiting make way; the job trains on through each."""
    plan = TrainPlan(
        job_id=JOB, generation=1, credential=driver_token(JOB), stages=stage_endpoints([agent.grpc_address] * 2,
                                                                                       [0, 1, 2]),
        dataset=DATASET, epochs=100, learning_rate=0.1, micro_batches=2, seed=0, rpc_timeout_seconds=30.0,
    )
    sink = StoppableSink()
    failures: list[BaseException] = []

    def training() -> None:
        try:
            train(plan, sink)
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    trainer = threading.Thread(target=training)
    trainer.start()
    try:
        wait_for_steps(sink, 2, failures)
        for who, count in (("stranger", 64), ("stranger", 256), ("neighbour", 64), ("neighbour", 256)):
            release = threading.Event()
            channel = stranger_channel(agent) if who == "stranger" else stub_as(agent, neighbour_token())[0]
            try:
                calls = stalled_calls(channel, count, release)
                held = 0 if who == "stranger" else WAITING_PER_CALLER  # what a known caller may have waiting
                still_open = settle(calls, refused=count - held, timeout=60)
                assert len(still_open) == held, (who, count, len(still_open))
                ended = {(c.code(), c.details() if who == "stranger" else "") for c in calls if c.done()}
                if who == "stranger":
                    assert ended == {(grpc.StatusCode.UNAUTHENTICATED, NOT_AUTHENTICATED)}, (who, count, ended)
                else:
                    # Methods no role of its may call are refused; the rest wait, the oldest making way.
                    assert {code for code, _ in ended} <= {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED,
                                                           grpc.StatusCode.RESOURCE_EXHAUSTED}, (who, count, ended)
                # While they are held, the health check answers within a second and the job makes steps.
                steps = len(sink.steps)
                deadline = time.monotonic() + 30
                while len(sink.steps) < steps + 3:
                    assert time.monotonic() < deadline and not failures, (who, count, failures)
                    health()
                    time.sleep(0.1)
            finally:
                release.set()
                channel.close()
    finally:
        sink.stop.set()
        trainer.join(timeout=60)
    assert not failures, failures  # no step failed: the driver never had to rewind
    assert len(sink.steps) >= 14 and all(math.isfinite(s.loss) for s in sink.steps)
    health()


def wait_for_steps(sink: RecordingSink, count: int, failures: list[BaseException]) -> None:
    deadline = time.monotonic() + 60
    while len(sink.steps) < count:
        assert time.monotonic() < deadline and not failures, failures
        time.sleep(0.05)


def _ref(stage_index: int) -> stage_pb2.StageRef:
    return stage_pb2.StageRef(job_id=JOB, stage_index=stage_index, generation=1)


def _memory_kib(agent: AgentProcess) -> dict[str, int]:
    """The agent's resident set now (VmRSS) and at its peak (VmHWM), in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{agent.process.pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}


def _rss_kib(agent: AgentProcess) -> int:
    return _memory_kib(agent)["VmRSS"]
