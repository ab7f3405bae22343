"""`PushStream` against a real agent: many pushes on one stream, refused messages answered in place,
stale generations refused; and against a misbehaving in-process server: broken and silent streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch

from arceus.contracts.transfer import TransferConfig
from arceus.v1 import stage_pb2, stage_pb2_grpc
from arceus.wire import codec
from arceus.wire.channels import open_channel
from arceus.wire.proto_tensor import write_encoded
from arceus.wire.push_stream import OutgoingPush, PushError, PushStream, outgoing_push, raw_push, serialize
from arceus.wire.transfer import TransferEncoder
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, pipeline_assignments

pytestmark = pytest.mark.slow

JOB = "stream-job"
MICRO_BATCHES = 4


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    own = f"127.0.0.1:{free_ports(1)[0]}"
    assignments = pipeline_assignments(
        job_id=JOB, addresses=[own, own], model_config={"layer_sizes": [64, 32, 10]}, boundaries=[0, 1, 2],
        optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=MICRO_BATCHES, max_micro_batch_size=16,
    )
    [started] = spawn_static_agents([assignments], [own], tmp_path_factory.mktemp("stream-agent"))
    try:
        yield started
    finally:
        assert stop_agents([started]) == [0]
    assert "Traceback" not in started.log_text()


@pytest.fixture
def stream(agent: AgentProcess) -> Iterator[PushStream]:
    with open_channel(agent.grpc_address, token=driver_token(JOB), certificate=agent.certificate) as channel:
        pushes = PushStream(channel)
        yield pushes
        pushes.close()


def activation(
    step: int, micro_batch: int = 0, *, generation: int = 1, features: int = 64, ack_later: bool = False
) -> OutgoingPush:
    ref = stage_pb2.StageRef(job_id=JOB, stage_index=0, generation=generation)
    dtype, shape, data = codec.encode(torch.randn(2, features))
    push = raw_push(ref, stage_pb2.ACTIVATION, step, micro_batch, dtype, shape, data)
    push.header.ack_later = ack_later
    return push


def failure(future: futures.Future[None]) -> PushError:
    error = future.exception(timeout=10)
    assert isinstance(error, PushError)
    return error


def test_serialized_push_parses_as_the_plain_request() -> None:
    push = activation(7, 3)
    parsed = stage_pb2.PushTensorRequest.FromString(serialize(push))
    expected = stage_pb2.PushTensorRequest()
    expected.CopyFrom(push.header)
    expected.tensor.data = bytes(push.data)
    assert parsed == expected


@pytest.mark.parametrize("encoding", ["fp32", "int8"])
def test_an_encoded_push_parses_as_the_request_write_encoded_builds(encoding: str) -> None:
    encoder = TransferEncoder(TransferConfig(activations=encoding))
    encoded = encoder.encode(torch.randn(3, 100), gradient=False, stream=0)
    ref = stage_pb2.StageRef(job_id=JOB, stage_index=1, generation=1)
    expected = stage_pb2.PushTensorRequest(target=ref, kind=stage_pb2.ACTIVATION, step=5, micro_batch=1)
    write_encoded(expected.tensor, encoded)
    push = outgoing_push(ref, stage_pb2.ACTIVATION, 5, 1, encoded)
    assert stage_pb2.PushTensorRequest.FromString(serialize(push)) == expected


def test_many_micro_batches_travel_over_one_stream(stream: PushStream) -> None:
    sent = [stream.push(activation(step, m), timeout=10) for step in range(1, 26) for m in range(MICRO_BATCHES)]
    call = stream._call
    for future in sent:
        assert future.result(timeout=10) is None
    assert stream._call is call  # no reopen


def test_a_refused_message_gets_an_error_ack_and_the_stream_goes_on(stream: PushStream) -> None:
    good = stream.push(activation(100), timeout=10)
    bad = stream.push(activation(101, features=63), timeout=10)
    out_of_range = stream.push(activation(102, MICRO_BATCHES), timeout=10)
    after = stream.push(activation(103), timeout=10)
    assert good.result(timeout=10) is None
    error = failure(bad)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape [batch, 64]" in error.details()
    assert failure(out_of_range).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert after.result(timeout=10) is None


def test_a_stale_generation_is_refused(stream: PushStream) -> None:
    stale = stream.push(activation(200, generation=0), timeout=10)
    error = failure(stale)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED  # the driver's credential is generation 1's
    assert "generation" not in error.details()
    assert stream.push(activation(201), timeout=10).result(timeout=10) is None


def test_pushes_sent_for_a_later_ack_are_answered_by_the_next_ack(stream: PushStream) -> None:
    early = [stream.push(activation(300, m, ack_later=True), timeout=10) for m in range(MICRO_BATCHES - 1)]
    time.sleep(0.3)
    assert not any(future.done() for future in early)  # taken, but not acked on their own
    assert stream.push(activation(300, MICRO_BATCHES - 1), timeout=10).result(timeout=10) is None
    assert all(future.result(timeout=1) is None for future in early)


def test_a_refused_push_is_answered_at_once_and_answers_those_before_it(stream: PushStream) -> None:
    taken = stream.push(activation(400, ack_later=True), timeout=10)
    refused = stream.push(activation(401, features=63, ack_later=True), timeout=10)
    assert failure(refused).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert taken.result(timeout=1) is None


def test_pushes_left_for_a_later_ack_are_answered_when_the_sender_half_closes(agent: AgentProcess) -> None:
    with open_channel(agent.grpc_address, token=driver_token(JOB), certificate=agent.certificate) as channel:
        pushes = PushStream(channel, lifetime=3)
        try:
            left = pushes.push(activation(500, ack_later=True), timeout=1)
            call = pushes._call
            assert pushes.push(activation(501), timeout=5).result(timeout=10) is None  # too long for the first call
            assert pushes._call is not call
            assert left.result(timeout=10) is None
        finally:
            pushes.close()


# --- a misbehaving receiver ---------------------------------------------------------------------------


class FlakyServicer(stage_pb2_grpc.StageServiceServicer):
    """Acks until told otherwise; then breaks the next stream, or stays silent on it."""

    def __init__(self) -> None:
        self.mode = "ack"
        self.streams = 0
        self.release = threading.Event()

    def PushStream(self, request_iterator, context):  # noqa: ANN001, ANN201, N802 - gRPC's signature
        self.streams += 1
        for request in request_iterator:
            if self.mode == "break":
                self.mode = "ack"
                context.abort(grpc.StatusCode.UNAVAILABLE, "receiver restarting")
            if self.mode == "silent":
                self.mode = "ack"
                self.release.wait(10)
                return
            yield stage_pb2.PushAck(kind=request.kind, step=request.step, micro_batch=request.micro_batch)
            if self.mode == "end":  # (an agent that stopped hosting, or restarted, between steps)
                self.mode = "ack"
                return


@pytest.fixture
def flaky() -> Iterator[tuple[FlakyServicer, PushStream]]:
    servicer = FlakyServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    pushes = PushStream(channel)
    try:
        yield servicer, pushes
    finally:
        servicer.release.set()
        pushes.close()
        channel.close()
        server.stop(0)


def test_a_broken_stream_fails_its_push_and_is_reopened(flaky: tuple[FlakyServicer, PushStream]) -> None:
    servicer, pushes = flaky
    assert pushes.push(activation(1), timeout=5).result(timeout=5) is None
    servicer.mode = "break"
    error = failure(pushes.push(activation(2), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "receiver restarting" in error.details()
    assert pushes.push(activation(3), timeout=5).result(timeout=5) is None
    assert servicer.streams == 2


def test_an_unacked_push_fails_by_its_deadline_and_the_next_push_reopens(
    flaky: tuple[FlakyServicer, PushStream],
) -> None:
    servicer, pushes = flaky
    servicer.mode = "silent"
    started = time.monotonic()
    error = failure(pushes.push(activation(1), timeout=0.5))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3
    assert pushes.push(activation(2), timeout=5).result(timeout=5) is None
    assert servicer.streams == 2


def test_a_push_due_before_the_ones_in_flight_is_held_to_its_own_deadline(
    flaky: tuple[FlakyServicer, PushStream],
) -> None:
    """The deadline watchdog sleeps until the earliest deadline it knows; a push due sooner must wake it."""
    servicer, pushes = flaky
    servicer.mode = "silent"
    late = pushes.push(activation(1), timeout=60)
    time.sleep(0.2)  # the watchdog now sleeps until the late push's deadline
    started = time.monotonic()
    error = failure(pushes.push(activation(2), timeout=0.5))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3
    assert failure(late).code() == grpc.StatusCode.DEADLINE_EXCEEDED  # the stream they shared was cancelled


def test_a_stream_the_receiver_ended_while_idle_is_replaced_before_the_next_push(
    flaky: tuple[FlakyServicer, PushStream],
) -> None:
    servicer, pushes = flaky
    servicer.mode = "end"
    assert pushes.push(activation(1), timeout=5).result(timeout=5) is None
    call = pushes._call
    deadline = time.monotonic() + 5
    while call.usable(5) and time.monotonic() < deadline:  # its reader, idle, still learns of the end at once
        time.sleep(0.01)
    assert not call.usable(5)
    assert pushes.push(activation(2), timeout=5).result(timeout=5) is None
    assert servicer.streams == 2


def test_an_idle_streams_ack_reader_sleeps_until_an_ack_is_due(flaky: tuple[FlakyServicer, PushStream]) -> None:
    """gRPC's response iterator wakes every 0.1 s while it waits: a reader left in it between pushes would wake ten
    times a second on every open stream of every agent."""
    _, pushes = flaky
    assert pushes.push(activation(1), timeout=5).result(timeout=5) is None
    [reader] = [t for t in threading.enumerate() if t.name == "push-acks"]
    before = _wake_ups(reader)
    time.sleep(1.0)
    assert _wake_ups(reader) - before <= 1
    assert pushes.push(activation(2), timeout=5).result(timeout=5) is None


def _wake_ups(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))


def test_a_closed_stream_refuses_pushes(flaky: tuple[FlakyServicer, PushStream]) -> None:
    _, pushes = flaky
    pushes.close()
    assert failure(pushes.push(activation(1), timeout=5)).code() == grpc.StatusCode.CANCELLED
