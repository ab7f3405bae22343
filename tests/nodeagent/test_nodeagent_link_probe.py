"""The neighbour link probe: `LinkProbeService` (bounded sizes, deadlines), the timing client, the
background thread that measures the neighbours of the hosted stages, and the heartbeat that reports it."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from arceus.contracts.assignment import Assignment
from arceus.contracts.certificates import AGENT_TLS_NAME
from arceus.placement.solver import Device, LayerProfile, Workload, solve
from arceus.v1 import link_probe_pb2, link_probe_pb2_grpc
from arceus.wire.channels import open_channel, pinned_channel_credentials
from devtools.pipeline import driver_token, identity_for, pipeline_assignments, remember_identity
from nodeagent.agent import Agent
from nodeagent.control_plane import ControlPlaneClient, HeartbeatLoop
from nodeagent.link_probe import _CHANNEL_OPTIONS, MAX_PROBE_BYTES, LinkFigures, least_delay, measure_neighbour
from nodeagent.neighbour_links import Neighbour, NeighbourLinks
from tests.nodeagent.test_nodeagent_control_plane import wait_for


@pytest.fixture
def agent() -> Iterator[Agent]:
    """An agent hosting one stage of job "probed": that job's principals may time links to it."""
    a = Agent(device=torch.device("cpu"))
    a.start()
    [raw] = pipeline_assignments(
        job_id="probed", model_config={"layer_sizes": [8, 4]}, boundaries=[0, 1], addresses=[a.advertise_address],
        optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=1, max_micro_batch_size=4,
    )
    a.apply_assignments([Assignment.from_json(raw)])
    try:
        yield a
    finally:
        a.stop(grace=1)


@pytest.fixture
def probe(agent: Agent) -> Iterator[grpc.UnaryUnaryMultiCallable]:
    certificate = agent.identity.certificate
    with open_channel(agent.grpc_address, token=driver_token("probed"), certificate=certificate,
                      options=_CHANNEL_OPTIONS) as channel:
        yield link_probe_pb2_grpc.LinkProbeServiceStub(channel).Probe


def test_a_probe_without_a_credential_the_agent_accepts_is_refused(agent: Agent) -> None:
    certificate = agent.identity.certificate
    for channel in (
        grpc.secure_channel(
            agent.grpc_address, pinned_channel_credentials(certificate),
            options=[("grpc.ssl_target_name_override", AGENT_TLS_NAME)],
        ),  # TLS, but no token
        open_channel(agent.grpc_address, token=driver_token("another-job"), certificate=certificate),
    ):
        with channel, pytest.raises(grpc.RpcError) as caught:
            link_probe_pb2_grpc.LinkProbeServiceStub(channel).Probe(link_probe_pb2.ProbeRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(("payload", "reply_bytes"), [(0, 0), (1000, 0), (0, 1000), (MAX_PROBE_BYTES, MAX_PROBE_BYTES)])
def test_probe_takes_and_returns_bounded_filler(probe, payload: int, reply_bytes: int) -> None:  # noqa: ANN001
    reply = probe(link_probe_pb2.ProbeRequest(payload=bytes(payload), reply_bytes=reply_bytes), timeout=10)
    assert len(reply.payload) == reply_bytes


@pytest.mark.parametrize(("payload", "reply_bytes"), [(MAX_PROBE_BYTES + 1, 0), (0, MAX_PROBE_BYTES + 1), (0, -1)])
def test_oversized_or_negative_probes_are_refused(probe, payload: int, reply_bytes: int) -> None:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as caught:
        probe(link_probe_pb2.ProbeRequest(payload=bytes(payload), reply_bytes=reply_bytes), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must each lie in [0, 4194304]" in caught.value.details()


def test_measure_neighbour_times_a_live_agent(agent: Agent) -> None:
    figures = measure_neighbour(
        agent.grpc_address, driver_token("probed"), agent.identity.certificate, bulk_bytes=1024 * 1024
    )
    assert figures is not None and figures.rtt_seconds > 0 and figures.bandwidth_bytes_per_second > 0


class FakeClock:
    """Time that passes only as probes take it and the rounds' spacing sleeps it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def probe(self, samples: list[float]) -> Callable[[], float]:
        """A probe timing `samples` in turn (and taking that long)."""
        def timed() -> float:
            sample = samples[self.calls]
            self.calls += 1
            self.now += sample
            return sample

        return timed

    def sleep(self, seconds: float) -> None:
        self.now += seconds


# Round trips to 127.0.0.1 timed while agents start beside each other on a loaded machine: a burst of seconds, and
# within a few a quiet moment.
LOADED = [1.7, 0.9, 0.02, 0.0003, 1.1, 0.0004, 0.6, 0.3]


def least(clock: FakeClock, samples: list[float], **kwargs: float) -> float:
    return least_delay(clock.probe(samples), clock=lambda: clock.now, sleep=clock.sleep, **kwargs)


def test_a_links_delay_is_the_least_of_rounds_spread_over_a_bounded_time() -> None:
    clock = FakeClock()
    assert least(clock, LOADED, rounds=8, spacing=0.1, budget=10.0, enough=0.0) == 0.0003
    assert clock.calls == 8
    clock = FakeClock()
    assert least(clock, LOADED) == 0.0003 and clock.calls == 4  # the defaults; short enough: no more rounds
    # Bounded: no round begins past the budget; the first always runs.
    clock = FakeClock()
    assert least(clock, [1.7] * 8, rounds=8, spacing=0.1, budget=4.0) == 1.7
    assert clock.calls == 3 and clock.now <= 4.0 + 1.7
    clock = FakeClock()
    assert least(clock, [1.7] * 8, rounds=8, spacing=0.1, budget=1.0) == 1.7 and clock.calls == 1
    # A quiet link's rounds end after three once the least is short enough to matter to no placement.
    clock = FakeClock()
    assert least(clock, [0.0001] * 8) == 0.0001 and clock.calls == 3
    clock = FakeClock()
    assert least(clock, [0.03] * 8, enough=0.002, budget=10.0) == 0.03 and clock.calls == 8


def test_a_split_planned_on_loaded_probes_is_the_split_of_the_quiet_link() -> None:
    """Agents on one loaded host, three of them probing through seconds of load: with each link's delay the least of
    its rounds the solver splits 20 equal blocks 5/5/5/5, as on the quiet loopback; the 1.6-1.7 s that three quick
    rounds inside the burst read would skew the split, and the stages' memory with it."""
    block = LayerProfile(2e9, 12_600_000, 4 * 128 * 2048, stash_bytes_per_sample=40 * 128 * 2048)
    layers = [block] * 20
    workload = Workload(1, 8, "1f1b")

    def split(delays: list[float]) -> list[int]:
        devices = [Device(f"agent-{i}", 2e10, 2**40, latency_s=rtt / 2) for i, rtt in enumerate(delays)]
        placement = solve(layers, devices, workload, min_stages=4, max_stages=4)
        return [s.layer_end - s.layer_start for s in placement.stages]

    measured = [least(FakeClock(), samples) for samples in ([0.003] * 8, LOADED, LOADED[1:] + LOADED[:1], LOADED)]
    assert split(measured) == [5, 5, 5, 5]
    assert split([0.003, 1.7, 1.6, 1.7]) != [5, 5, 5, 5]


def test_a_silent_or_absent_neighbour_is_unknown_within_the_deadline() -> None:
    with socket.socket() as silent:  # accepts connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        silent_address = f"127.0.0.1:{silent.getsockname()[1]}"
        certificate = identity_for(silent_address).certificate
        assert measure_neighbour(silent_address, "0" * 64, certificate, timeout=0.5) is None
        assert time.monotonic() - started < 3
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    closed_address = f"127.0.0.1:{port}"
    assert measure_neighbour(closed_address, "0" * 64, identity_for(closed_address).certificate, timeout=0.5) is None


def test_the_thread_measures_when_woken_reports_once_and_failures_as_unknown() -> None:
    def measure(address: str, token: str, certificate: str) -> LinkFigures | None:
        if address == "bad:1":
            raise RuntimeError("probe bug")
        return None if address == "down:1" else LinkFigures(0.01, 1e6)

    neighbours = {address: Neighbour("t", "c") for address in ("up:1", "down:1", "bad:1")}
    links = NeighbourLinks(lambda: neighbours, lambda: False, interval=300, measure=measure, probe_retries=(0.01,))
    links.start()
    try:
        links.wake()
        taken: list = []
        wait_for(lambda: len(taken.extend(links.take()) or taken) == 3)
        assert sorted(taken, key=lambda f: f["address"]) == [
            {"address": "bad:1", "rtt_seconds": None, "bandwidth_bytes_per_second": None},
            {"address": "down:1", "rtt_seconds": None, "bandwidth_bytes_per_second": None},
            {"address": "up:1", "rtt_seconds": 0.01, "bandwidth_bytes_per_second": 1e6},
        ]
        assert links.take() == []  # reported once
    finally:
        links.stop()


def test_the_thread_waits_for_a_pause_between_steps() -> None:
    stepping = [True]
    links = NeighbourLinks(
        lambda: {"n:1": Neighbour("t", "c")}, lambda: stepping[0], interval=300,
        measure=lambda _a, _t, _c: LinkFigures(0.01, 1e6),
        busy_retry=0.02,
    )
    links.start()
    try:
        links.wake()
        time.sleep(0.3)
        assert links.take() == []  # a step is running: not yet
        stepping[0] = False
        taken: list = []
        wait_for(lambda: bool(taken.extend(links.take()) or taken))
        assert [f["address"] for f in taken] == ["n:1"]
    finally:
        links.stop()


def two_stage_agents() -> tuple[list[Agent], list[dict]]:
    agents = [Agent(device=torch.device("cpu"), link_probe_interval=300.0) for _ in range(2)]
    for a in agents:
        a.start()
        remember_identity(a.advertise_address, a.identity)
    raw = pipeline_assignments(
        job_id="job", model_config={"layer_sizes": [8, 6, 4]}, boundaries=[0, 1, 2],
        addresses=[a.advertise_address for a in agents], optimizer={"name": "sgd", "lr": 0.1}, seed=0,
        micro_batches=2, max_micro_batch_size=4,
    )
    for a, assignment in zip(agents, raw, strict=True):
        a.apply_assignments([Assignment.from_json(assignment)])
    return agents, raw


def test_agents_measure_their_neighbours_once_their_stages_are_built() -> None:
    agents, _ = two_stage_agents()
    try:
        for a, neighbour in zip(agents, reversed(agents), strict=True):
            taken: list = []
            wait_for(lambda a=a, taken=taken: bool(taken.extend(a.neighbour_links.take()) or taken), timeout=30)
            assert [f["address"] for f in taken] == [neighbour.advertise_address]
            assert taken[0]["rtt_seconds"] > 0 and taken[0]["bandwidth_bytes_per_second"] > 0
    finally:
        for a in agents:
            a.stop(grace=1)


def test_the_heartbeat_carries_the_figures_until_one_is_accepted(control_plane) -> None:  # noqa: ANN001
    agents, raw = two_stage_agents()
    control_plane.assignments = raw[:1]  # the first agent keeps its stage
    control_plane.interval = 0.05
    control_plane.heartbeat_override = (503, b"{}")  # a lost heartbeat must not lose the figures
    client = ControlPlaneClient(control_plane.url, control_plane.token)
    loop = HeartbeatLoop(client, agents[0], interval=0.05, on_fatal=print, min_backoff=0.05, max_backoff=0.05)
    loop.start()
    try:
        wait_for(lambda: any("neighbour_links" in b for b in control_plane.heartbeats()), timeout=30)
        failed = len(control_plane.heartbeats())
        control_plane.heartbeat_override = None
        wait_for(lambda: len(control_plane.heartbeats()) > failed + 3)
        reported = [b["neighbour_links"] for b in control_plane.heartbeats()[failed - 1:] if "neighbour_links" in b]
        assert reported and reported[-1][0]["address"] == agents[1].advertise_address
        assert reported[-1][0]["bandwidth_bytes_per_second"] > 0
        assert "neighbour_links" not in control_plane.heartbeats()[-1]  # sent once accepted, not again
    finally:
        loop.stop()
        for a in agents:
            a.stop(grace=1)
