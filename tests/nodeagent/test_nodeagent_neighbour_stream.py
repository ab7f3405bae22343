"""nodeagent.neighbour_stream: the frames each way on a link follow both stages' schedules; a neighbour stream is
taken only from the previous stage's agent presenting its token; a frame is checked against the one due and the
stage's layout before a byte of its payload is allocated; compressed tensors arrive as PushStream decodes them."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.contracts.assignment import Assignment
from arceus.contracts.data_plane import NEIGHBOUR_STREAM
from arceus.pipeline.schedule import SCHEDULES, build_schedule
from arceus.wire.compression import decode_payload, encode
from arceus.wire.tls import new_identity
from devtools.pipeline import driver_token, pipeline_assignments, remember_identity
from nodeagent.agent import Agent
from nodeagent.neighbour_stream import (
    ACK,
    ACTIVATION,
    FRAME,
    GRADIENT,
    NeighbourHello,
    frame_header,
    link_frames,
    streamed_links,
)
from nodeagent.peer_streams import PeerStreams
from nodeagent.rpc import RpcFailure
from nodeagent.stage import HostedStage

MODEL = {"type": "mlp", "layer_sizes": [8, 16, 4]}


@given(st.sampled_from(sorted(SCHEDULES)), st.integers(2, 5), st.integers(1, 6), st.booleans(), st.data())
def test_a_link_carries_each_activation_and_gradient_once_in_its_senders_order_and_one_ack_each_way(
    schedule: str, stages: int, micro_batches: int, train: bool, data: st.DataObject,
) -> None:
    every = build_schedule(schedule, stages, micro_batches, train)
    lower = data.draw(st.integers(0, stages - 2))
    down, up = link_frames(every[lower], every[lower + 1])
    assert [f for f in down if f[0] != ACK] == [(ACTIVATION, a.micro_batch) for a in every[lower] if a.kind == "F"]
    assert [f for f in up if f[0] != ACK] == [(GRADIENT, a.micro_batch) for a in every[lower + 1] if a.kind == "B"]
    # An ACK goes back once the other side's frames were all taken, and only where there were any.
    assert down.count((ACK, 0)) == (1 if train else 0) and up.count((ACK, 0)) == 1
    if train:  # the lower stage takes its last gradient in its last backward, after every forward it sends
        assert down[-1] == (ACK, 0)


@pytest.fixture
def pipeline() -> Iterator[tuple[list[Agent], list[dict]]]:
    """Stages 0 and 1 of a 2-stage MLP, each on an agent of its own in this process."""
    agents = [Agent(device=torch.device("cpu")) for _ in range(2)]
    try:
        for agent in agents:
            agent.start()
            remember_identity(agent.advertise_address, agent.identity)
        raw = pipeline_assignments(
            job_id="nb", model_config=MODEL, boundaries=[0, 1, 2], addresses=[a.advertise_address for a in agents],
            optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}, seed=0, micro_batches=2,
            max_micro_batch_size=4,
        )
        for agent, assignment in zip(agents, raw, strict=True):
            agent.apply_assignments([Assignment.from_json(assignment)])
        yield agents, raw
    finally:
        for agent in agents:
            agent.stop(grace=1)


def hosted(agent: Agent) -> HostedStage:
    (stage,) = agent.registry.stages()
    return stage


def dial(agent: Agent, identity_of: Agent | None, hello: NeighbourHello) -> ssl.SSLSocket:
    """A stream to `agent`'s listener as the agent `identity_of` (None: a stranger) dials it."""
    identity = identity_of.identity if identity_of is not None else new_identity()
    return PeerStreams(identity).dial(agent.advertise_address, "", agent.exchange_streams.port,
                                      agent.identity.certificate, hello.pack(), time.monotonic() + 10, peer="stage 1")


def closed(sock: ssl.SSLSocket) -> bool:
    sock.settimeout(10)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except (ssl.SSLError, OSError):
        pass
    return True


def test_only_links_between_two_one_agent_stages_are_streamed(pipeline) -> None:
    _, raw = pipeline
    first, last = (Assignment.from_json(a) for a in raw)
    assert streamed_links(first) == (False, True) and streamed_links(last) == (True, False)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.frozensets(st.sampled_from([NEIGHBOUR_STREAM, "rdma"])), min_size=2, max_size=4),
       st.sampled_from([0, 1]))
def test_both_ends_of_every_link_reach_the_same_transport_from_their_own_assignments(
    features: list[frozenset[str]], staleness: int,
) -> None:
    """Whatever each agent declared (none: an older agent), the lower end's "next" and the upper end's "prev" agree:
    a neighbour stream exactly where both agents speak it and the job has staleness 0; PushStream elsewhere."""
    raw = pipeline_assignments(
        job_id="mixed", model_config={"type": "mlp", "layer_sizes": [8] * (len(features) + 1)},
        boundaries=list(range(len(features) + 1)), addresses=[f"127.0.0.1:{9000 + i}" for i in range(len(features))],
        optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=2, max_micro_batch_size=4, staleness=staleness,
        features=features,
    )
    links = [streamed_links(Assignment.from_json(a)) for a in raw]
    assert not links[0][0] and not links[-1][1]
    for lower in range(len(features) - 1):
        both = NEIGHBOUR_STREAM in features[lower] & features[lower + 1]
        assert links[lower][1] == links[lower + 1][0] == (both and staleness == 0)


def test_a_neighbour_stream_is_taken_only_from_the_previous_stages_agent_presenting_its_token(pipeline) -> None:
    (previous, receiver), raw = pipeline
    token = raw[0]["credentials"]["token"]
    stage = hosted(receiver)
    with pytest.raises((RpcFailure, ssl.SSLError)):  # a certificate its assignment does not name: no handshake
        stranger = dial(receiver, None, NeighbourHello("nb", 1, 1, 0, token))
        stranger.settimeout(10)
        stranger.recv(1)
    for refused in (
        NeighbourHello("nb", 1, 1, 0, "0" * 64),  # not its previous stage's token
        NeighbourHello("nb", 1, 1, 0, driver_token("nb", 1)),  # the driver's: not role PREV
        NeighbourHello("nb", 1, 1, 1, token),  # claims to be another stage
        NeighbourHello("nb", 1, 2, 0, token),  # another generation
        NeighbourHello("other", 1, 1, 0, token),
    ):
        assert closed(dial(receiver, previous, refused)), refused
    assert stage.neighbours._offers.kept(0) is None
    dial(receiver, previous, NeighbourHello("nb", 1, 1, 0, token))
    deadline = time.monotonic() + 10
    while stage.neighbours._offers.kept(0) is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def receiving(stage: HostedStage, micro_batches: tuple[int, ...] = (0,)) -> tuple[threading.Thread, dict[str, object]]:
    """Stage 1's step 1 reading `micro_batches`' activations off its neighbour stream, in a thread."""
    got: dict[str, object] = {}

    def run() -> None:
        wire = stage.neighbours.begin(1, build_schedule("gpipe", 2, 2, True), time.monotonic() + 10,
                                      threading.Event())
        try:
            for m in micro_batches:
                got[m] = wire.receive(ACTIVATION, m)
        except RpcFailure as exc:
            got["error"] = exc
            wire.fail()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def test_a_frame_is_refused_on_its_header_before_its_payload_is_read(pipeline) -> None:
    """Each header below promises a payload it never sends: the step fails at once, not at its deadline."""
    (previous, receiver), raw = pipeline
    token, stage = raw[0]["credentials"]["token"], hosted(receiver)
    values = encode(torch.ones(2, 16), "fp32")
    # more rows than max_micro_batch_size, and the bytes to match
    huge = FRAME.pack(b"ANF1", 1, 0, ACTIVATION, b"float32", 0, 0, 2, 1 << 20, 16, *[0] * 6, (1 << 20) * 64, 0, 0)
    wide = encode(torch.ones(2, 17), "fp32")  # not the stage's input layout
    for header, code, words in (
        (frame_header(2, 0, ACTIVATION, values), grpc.StatusCode.FAILED_PRECONDITION, "frame of step 2"),
        (frame_header(1, 1, ACTIVATION, values), grpc.StatusCode.FAILED_PRECONDITION, "micro-batch 1 where"),
        (frame_header(1, 0, GRADIENT, values), grpc.StatusCode.FAILED_PRECONDITION, "kind GRADIENT"),
        (huge, grpc.StatusCode.INVALID_ARGUMENT, "batch dimension must be in [1, 4]"),
        (frame_header(1, 0, ACTIVATION, wide), grpc.StatusCode.INVALID_ARGUMENT, "must have shape [batch, 16]"),
        (FRAME.pack(b"ANF1", 1, 0, ACTIVATION, b"float32", 0, 0, 2, 2, 16, *[0] * 6, 1 << 40, 0, 0),
         grpc.StatusCode.INVALID_ARGUMENT, "must be 128 bytes, got 1,099,511,627,776"),
    ):
        sock = dial(receiver, previous, NeighbourHello("nb", 1, 1, 0, token))
        thread, got = receiving(stage)
        sock.sendall(header)
        started = time.monotonic()
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - started < 5
        error = got["error"]
        assert isinstance(error, RpcFailure) and error.code == code and words in error.message, error.message
        assert closed(sock)


@pytest.mark.parametrize("encoding", ["fp32", "int8", "topk", "bf16"])
def test_tensors_arrive_as_their_encoding_decodes_and_one_ack_follows_the_last(pipeline, encoding: str) -> None:
    (previous, receiver), raw = pipeline
    token, stage = raw[0]["credentials"]["token"], hosted(receiver)
    tensors = [torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows)) for rows in (3, 4)]
    encoded = [encode(t, encoding) for t in tensors]
    sock = dial(receiver, previous, NeighbourHello("nb", 1, 1, 0, token))
    thread, got = receiving(stage, (0, 1))
    for m, e in enumerate(encoded):
        sock.sendall(frame_header(1, m, ACTIVATION, e) + bytes(e.data) + bytes(e.scales) + bytes(e.indices))
    thread.join(10)
    for m, e in enumerate(encoded):
        assert torch.equal(got[m], decode_payload(e))
    assert stage.bytes_received == sum(e.nbytes for e in encoded)
    # Both taken: the step acks them, once.
    sock.settimeout(10)
    ack = b""
    while len(ack) < FRAME.size:
        ack += sock.recv(FRAME.size - len(ack))
    assert ack == frame_header(1, 0, ACK)
