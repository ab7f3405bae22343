"""The agent's control-plane client and heartbeat loop against a real HTTP server (see conftest)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import save_file

from arceus.checkpoint import StateFile, checkpoint_digest, encode_checkpoint
from arceus.contracts.assignment import Assignment, CheckpointRef, InitialWeightsRef
from arceus.contracts.credentials import token_digest
from arceus.contracts.data_plane import NEIGHBOUR_STREAM
from arceus.contracts.possession import possession_check
from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.hugging_face import initial_weights_layer_digests, initial_weights_slice, initial_weights_slice_bytes
from arceus.model.llama.hf import hf_name
from arceus.model.registry import model_spec_from_config
from arceus.safetensors_file import CheckpointError
from arceus.wire.tls import new_identity
from nodeagent.agent import Agent
from nodeagent.control_plane import (
    PROBE_BYTES,
    ControlPlaneClient,
    HeartbeatLoop,
    measure_link,
    register_until_accepted,
)
from nodeagent.control_plane_http import ControlPlaneError, Unauthorized
from nodeagent.stage import StateUploadError
from tests.arceus.model.test_llama_model import SMALL
from tests.nodeagent.conftest import ASSIGNMENT


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_register_sends_the_contract_with_a_proof_of_its_key(control_plane) -> None:  # noqa: ANN001 - conftest
    client = ControlPlaneClient(control_plane.url + "/", control_plane.token)
    caps = {"device_type": "cpu", "device_name": "x", "memory_bytes": 1, "flops_fp32": 2.0}
    identity = new_identity()
    registration = client.register("127.0.0.1:5000", caps, "ab" * 32, identity)
    assert (registration.node_id, registration.heartbeat_interval_seconds) == ("node-1", 0.5)
    assert [path for path, _, _ in control_plane.requests] == ["/api/agent/challenge", "/api/agent/register"]
    _, headers, body = control_plane.requests[1]
    assert headers["Authorization"] == "Node good-token"
    proof = body.pop("tls_proof")
    assert body == {
        "grpc_address": "127.0.0.1:5000", "capabilities": caps, "public_key": "ab" * 32,
        "tls_certificate": identity.certificate, "challenge": control_plane.challenges[0],
        "data_plane": [NEIGHBOUR_STREAM],  # this version's data-plane features: its links may take neighbour streams
    }
    possession_check(identity.certificate, control_plane.challenges[0], proof)  # the fake checks it too
    client.register("127.0.0.1:5000", caps, "ab" * 32, identity, metrics_port=9400)
    assert control_plane.requests[3][2]["metrics_port"] == 9400  # where Prometheus scrapes it


def test_rejected_token_is_unauthorized(control_plane) -> None:  # noqa: ANN001
    client = ControlPlaneClient(control_plane.url, "wrong")
    with pytest.raises(Unauthorized, match="rejected the node token"):
        register_until_accepted(client, "h:1", {}, "", new_identity(), stop=threading.Event())
    with pytest.raises(Unauthorized, match=r"check the token \(ARCEUS_NODE_TOKEN or the token file\)"):
        client.heartbeat([])


def test_unreachable_control_plane_is_retried_until_stopped() -> None:
    client = ControlPlaneClient("http://127.0.0.1:9", "t", timeout=0.5)
    with pytest.raises(ControlPlaneError, match="failed"):
        client.register("h:1", {}, "", new_identity())
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert register_until_accepted(client, "h:1", {}, "", new_identity(), stop=stop, min_backoff=0.05) is None


def test_the_link_is_the_networks_round_trip_not_the_web_servers_handling(control_plane) -> None:  # noqa: ANN001
    # A busy web server answers each probe 0.1 s late: the round trip is the network's (TCP handshakes, here on
    # loopback), not that handling, which placement would charge every replica's exchange; the bandwidth is the
    # upload's time less the same handling, not less the round trip.
    control_plane.probe_seconds = 0.1
    link = measure_link(ControlPlaneClient(control_plane.url, control_plane.token))
    assert link is not None and link["rtt_seconds"] < 0.01, link
    assert link["bandwidth_bytes_per_second"] > PROBE_BYTES / 0.1, link
    assert [path for path, *_ in control_plane.requests] == ["/api/agent/probe"] * 6  # 3 empty, 3 uploads
    assert measure_link(ControlPlaneClient("http://127.0.0.1:9", "t", timeout=0.5)) is None  # unreachable: unknown


def test_heartbeat_applies_assignments_and_reports_readiness_at_once(control_plane, agent: Agent) -> None:  # noqa: ANN001
    control_plane.interval = 30.0  # long: a second heartbeat can only come from the immediate re-send
    control_plane.assignments = [ASSIGNMENT, {"stage_id": "bad-stage", "generation": 4}]
    loop = HeartbeatLoop(
        ControlPlaneClient(control_plane.url, control_plane.token),
        agent,
        interval=30.0,
        on_fatal=lambda message: None,
    )
    loop.start()
    try:
        wait_for(lambda: len(control_plane.heartbeats()) >= 2, timeout=5)
    finally:
        loop.stop()
    first, second = control_plane.heartbeats()[:2]
    assert first["observed"] == [] and 0 <= first["host_busy_fraction"] <= 1
    observed = {o["stage_id"]: o for o in second["observed"]}
    assert observed["job-stage-0"] == {
        "stage_id": "job-stage-0",
        "generation": 1,
        "state": "ready",
        "message": "",
    }
    assert observed["bad-stage"]["state"] == "failed" and observed["bad-stage"]["generation"] == 4
    assert "invalid assignment" in observed["bad-stage"]["message"]
    assert agent.metrics._heartbeat_age() < 5


def test_the_metrics_answer_the_scrape_token_the_heartbeat_answer_names(control_plane, agent: Agent) -> None:  # noqa: ANN001
    url = f"http://{agent.metrics_address}/metrics"
    assert requests.get(url, params={"token": "p" * 64}, timeout=5).status_code == 403  # none named yet
    control_plane.scrape_digest = token_digest("p" * 64)
    loop = HeartbeatLoop(ControlPlaneClient(control_plane.url, control_plane.token), agent, interval=0.05,
                         on_fatal=lambda message: None)
    loop.start()
    try:
        wait_for(lambda: requests.get(url, params={"token": "p" * 64}, timeout=5).status_code == 200)
        control_plane.scrape_digest = token_digest("q" * 64)  # the operator rotated the metrics token
        wait_for(lambda: requests.get(url, params={"token": "q" * 64}, timeout=5).status_code == 200)
    finally:
        loop.stop()
    assert requests.get(url, params={"token": "p" * 64}, timeout=5).status_code == 401


@pytest.mark.parametrize(
    "override",
    [
        (500, b"oops"),
        (200, b"not json"),
        (200, b'{"node_id": "node-1", "heartbeat_interval_seconds": 0.1}'),  # no assignments list
        (200, b'{"node_id": "node-1", "assignments": [], "heartbeat_interval_seconds": -1}'),
        (200, b"[1, 2]"),
        (200, b'{"node_id": "node-1", "assignments": [], "heartbeat_interval_seconds": 1, "controls": '
              b'{"max_threads": 0}}'),
        (200, b'{"node_id": "node-1", "assignments": [], "heartbeat_interval_seconds": 1, "controls": '
              b'{"max_memory_bytes": "1 GB"}}'),
        (200, b'{"node_id": "node-1", "assignments": [], "heartbeat_interval_seconds": 1, '
              b'"metrics_token_sha256": "secret"}'),
        (200, b'{"node_id": "node-1", "assignments": [], "heartbeat_interval_seconds": 1, '
              b'"step_grants": {"job": -1}}'),
    ],
)
def test_bad_responses_keep_the_current_stages_and_the_loop_alive(
    control_plane,
    agent: Agent,  # noqa: ANN001
    override: tuple[int, bytes],
) -> None:
    control_plane.interval = 0.05
    control_plane.assignments = [ASSIGNMENT]
    fatal: list[str] = []
    loop = HeartbeatLoop(
        ControlPlaneClient(control_plane.url, control_plane.token),
        agent,
        interval=0.05,
        on_fatal=fatal.append,
        min_backoff=0.05,
        max_backoff=0.1,
    )
    loop.start()
    try:
        wait_for(lambda: [o["state"] for o in agent.observed()] == ["ready"])
        control_plane.heartbeat_override = override
        seen = len(control_plane.heartbeats())
        wait_for(lambda: len(control_plane.heartbeats()) >= seen + 3)  # it keeps trying
        assert [o["stage_id"] for o in agent.observed()] == ["job-stage-0"]  # nothing dropped
        control_plane.heartbeat_override = None
        control_plane.assignments = []
        wait_for(lambda: agent.observed() == [])  # and recovers
    finally:
        loop.stop()
    assert fatal == []


def test_rejected_token_during_heartbeats_is_fatal(control_plane, agent: Agent) -> None:  # noqa: ANN001
    control_plane.token = "rotated"
    fatal: list[str] = []
    loop = HeartbeatLoop(
        ControlPlaneClient(control_plane.url, "good-token"), agent, interval=0.05, on_fatal=fatal.append
    )
    loop.start()
    wait_for(lambda: bool(fatal))
    loop.stop()
    assert "rejected the node token" in fatal[0]


@pytest.fixture
def agent_of_two_threads() -> Iterator[Agent]:
    """An agent started with 2 torch threads, whatever this process computes with (one under pytest-xdist on two
    cores), so that a cap of 1 changes something."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    a = Agent(device=torch.device("cpu"))
    a.start()
    try:
        yield a
    finally:
        a.stop(grace=1)
        torch.set_num_threads(before)


def test_the_owners_thread_cap_is_taken_and_lifted(control_plane, agent_of_two_threads: Agent) -> None:  # noqa: ANN001
    agent = agent_of_two_threads
    started_with = agent.compute_threads
    assert started_with == 2
    control_plane.interval = 0.05
    control_plane.max_threads = 1
    loop = HeartbeatLoop(
        ControlPlaneClient(control_plane.url, control_plane.token), agent, interval=0.05, on_fatal=lambda m: None
    )
    loop.start()
    try:
        wait_for(lambda: agent.compute_threads == 1)
        control_plane.max_threads = 10_000  # a cap above what the agent was started with changes nothing
        wait_for(lambda: agent.compute_threads == started_with)
        control_plane.max_threads = None
        time.sleep(0.2)
        assert agent.compute_threads == started_with
    finally:
        loop.stop()


def test_a_stage_slow_to_build_does_not_hold_back_the_heartbeats(control_plane, tmp_path: Path) -> None:  # noqa: ANN001
    """A large checkpoint takes longer to download and load than the node's lease lasts: heartbeats go on."""
    spec = Assignment.from_json(ASSIGNMENT).spec
    data = encode_checkpoint(dict(named_global_parameters(build_layers(spec, 0, 1, seed=0))))
    path = tmp_path / "stage.safetensors"
    path.write_bytes(data)
    building = threading.Event()

    def slow_fetch(ref: CheckpointRef) -> StateFile:
        building.set()
        time.sleep(2.0)  # as a download of a large stage would take
        return StateFile(Path(ref.url), sha256=ref.sha256)

    agent = Agent(device=torch.device("cpu"), load_checkpoint=slow_fetch)
    agent.start()
    control_plane.interval = 0.2
    checkpoint = {"step": 3, "url": str(path), "sha256": checkpoint_digest(data)}
    control_plane.assignments = [{**ASSIGNMENT, "checkpoint": checkpoint}]
    loop = HeartbeatLoop(ControlPlaneClient(control_plane.url, control_plane.token), agent, interval=0.2,
                         on_fatal=lambda message: None)
    loop.start()
    try:
        assert building.wait(5)
        during = len(control_plane.heartbeats())
        time.sleep(1.5)
        assert len(control_plane.heartbeats()) >= during + 4  # every 0.2 s while the stage builds
        assert agent.observed() == []  # not ready yet, and not reported as anything else
        wait_for(lambda: [o["state"] for o in control_plane.heartbeats()[-1]["observed"]] == ["ready"])
    finally:
        loop.stop()
        agent.stop(grace=1)


def test_unchanged_assignments_are_kept_and_a_missing_list_of_another_version_is_refused(
    control_plane,  # noqa: ANN001
) -> None:
    client = ControlPlaneClient(control_plane.url, control_plane.token)
    control_plane.assignments = [ASSIGNMENT]
    first = client.heartbeat([])
    again = client.heartbeat([])
    sent = control_plane.heartbeats()
    assert "assignments_version" not in sent[0] and sent[1]["assignments_version"]  # so answered without the list
    held = [a.stage_id for a in again.assignments]
    assert held == [a.stage_id for a in first.assignments] == [ASSIGNMENT["stage_id"]]
    control_plane.assignments = []
    assert client.heartbeat([]).assignments == []  # a new version brings the new list
    control_plane.heartbeat_override = (200, b'{"node_id": "node-1", "assignments_version": "other", '
                                             b'"heartbeat_interval_seconds": 1}')
    with pytest.raises(ControlPlaneError, match="no 'assignments' list"):
        client.heartbeat([])


def test_the_agent_downloads_only_its_layers_of_uploaded_weights_and_checks_each(control_plane, tmp_path: Path) -> None:  # noqa: ANN001
    spec = model_spec_from_config(SMALL)
    path = tmp_path / "model.safetensors"
    save_file({hf_name(spec, n): p.detach() for n, p in named_global_parameters(build_full_model(spec, seed=3))}, path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        digests = initial_weights_layer_digests(spec, handle, size)
        _, chunks = initial_weights_slice(spec, handle, size, 1, 3)
        sliced = b"".join(chunks)
    control_plane.downloads["/api/agent/jobs/j/initial-weights?start=1&end=3"] = sliced
    client = ControlPlaneClient(control_plane.url, control_plane.token)
    ref = InitialWeightsRef(url="/api/agent/jobs/j/initial-weights", layer_sha256=tuple(digests[1:3]))
    bound = initial_weights_slice_bytes(spec, 1, 3)
    weights = client.fetch_initial_weights(ref, 1, 3, bound)
    stage = dict(named_global_parameters(build_layers(spec, 1, 3, seed=3)))
    assert sorted(weights) == sorted(stage) and len(sliced) < size and len(sliced) <= bound
    assert all(torch.equal(weights[name], tensor) for name, tensor in stage.items())

    forged = replace(ref, layer_sha256=(digests[1], digests[1]))  # what arrived is not what was uploaded
    with pytest.raises(CheckpointError, match="layer 2 of the initial weights hashes to"):
        client.fetch_initial_weights(forged, 1, 3, bound)
    with pytest.raises(ControlPlaneError, match="more than the 100 bytes expected"):
        client.fetch_initial_weights(ref, 1, 3, 100)


def test_a_state_goes_to_the_bucket_in_parts_a_failed_part_sent_again_without_the_node_token(control_plane) -> None:  # noqa: ANN001
    control_plane.part_bytes, control_plane.failed_parts = 1000, 1
    data = bytes(range(256)) * 10  # 2,560 bytes: three parts
    client = ControlPlaneClient(control_plane.url, control_plane.token)
    sha256 = client.upload_state("/api/agent/checkpoint-uploads/u-1", len(data), lambda: [data[:700], data[700:]], 30)
    assert sha256 == checkpoint_digest(data)
    sent = [path for path, _, _ in control_plane.requests]
    assert sent == ["/api/agent/checkpoint-uploads/u-1/parts", "/bucket/1", "/bucket/1", "/bucket/2", "/bucket/3",
                    "/api/agent/checkpoint-uploads/u-1/parts/complete"]
    assert b"".join(control_plane.uploads[f"/bucket/{n}"] for n in (1, 2, 3)) == data
    assert all(path.startswith("/bucket/") for path in control_plane.uploads)  # the node token went nowhere else


def test_a_direct_upload_whose_part_keeps_failing_is_left_open_for_a_resume(control_plane) -> None:  # noqa: ANN001
    control_plane.part_bytes, control_plane.failed_parts = 1000, 100
    client = ControlPlaneClient(control_plane.url, control_plane.token)
    with pytest.raises(StateUploadError, match=r"PUT part 1 of 1 → HTTP 500.*left for a resume"):
        client.upload_state("/api/agent/checkpoint-uploads/u-1", 10, lambda: [b"0123456789"], 2)
    assert [path for path, _, _ in control_plane.requests] == [
        "/api/agent/checkpoint-uploads/u-1/parts", "/bucket/1", "/bucket/1"  # sent again after 1 s; never aborted
    ]


def test_a_direct_upload_whose_state_cannot_be_read_is_aborted(control_plane) -> None:  # noqa: ANN001
    control_plane.part_bytes = 1000

    def chunks() -> Iterator[bytes]:
        yield b"0" * 1000
        raise RuntimeError("the stage's tensors are gone")

    client = ControlPlaneClient(control_plane.url, control_plane.token)
    with pytest.raises(RuntimeError, match="tensors are gone"):
        client.upload_state("/api/agent/checkpoint-uploads/u-1", 2000, chunks, 30)
    assert control_plane.requests[-1][0] == "/api/agent/checkpoint-uploads/u-1/parts?multipart_id=m-1"


