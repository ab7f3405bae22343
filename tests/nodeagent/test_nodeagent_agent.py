"""The agent's desired-state sync, in process, with real gRPC and metrics servers."""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import grpc
import pytest
import requests
import torch

from arceus.checkpoint import checkpoint_digest, decode_checkpoint
from arceus.contracts.assignment import Assignment
from arceus.contracts.credentials import token_digest
from arceus.contracts.observed import ObservedStage
from arceus.v1 import stage_pb2, stage_pb2_grpc
from arceus.wire.channels import open_channel
from devtools.pipeline import driver_token, pipeline_assignments, replicated_pipeline_assignments
from nodeagent.agent import Agent, split_host_port
from nodeagent.control_plane import ControlPlaneClient
from nodeagent.mailbox import MailboxClosed
from nodeagent.stage import HostedStage

MODEL = {"layer_sizes": [8, 6, 4]}


def stages(job_id: str = "job", generation: int = 1, model: dict[str, Any] = MODEL) -> list[Assignment]:
    raw = pipeline_assignments(
        job_id=job_id,
        model_config=model,
        boundaries=[0, 1, 2],
        addresses=["127.0.0.1:1", "127.0.0.1:2"],
        optimizer={"name": "sgd", "lr": 0.1},
        seed=0,
        micro_batches=2,
        max_micro_batch_size=4,
        generation=generation,
    )
    return [Assignment.from_json(a) for a in raw]


def driver_channel(agent: Agent) -> grpc.Channel:
    """What job "job"'s driver opens to the agent."""
    return open_channel(agent.grpc_address, token=driver_token("job"), certificate=agent.identity.certificate)


def states(agent: Agent) -> dict[str, tuple[int, str]]:
    return {o["stage_id"]: (o["generation"], o["state"]) for o in agent.observed()}


SCRAPE_TOKEN = "s" * 32


def scrape(agent: Agent) -> requests.Response:
    """GET its /metrics as Prometheus does, with the token the agent was told to accept."""
    agent.metrics.accept_scrapes(token_digest(SCRAPE_TOKEN))
    return requests.get(f"http://{agent.metrics_address}/metrics", params={"token": SCRAPE_TOKEN}, timeout=5)


def test_listens_on_ephemeral_ports(agent: Agent) -> None:
    assert agent.grpc_port > 0 and agent.metrics_port > 0
    assert agent.advertise_address == agent.grpc_address == f"127.0.0.1:{agent.grpc_port}"
    assert scrape(agent).status_code == 200


def test_metrics_answer_only_the_scrape_token(agent: Agent) -> None:
    agent.apply_assignments(stages())
    url = f"http://{agent.metrics_address}/metrics"
    off = requests.get(url, params={"token": SCRAPE_TOKEN}, timeout=5)  # before the control plane said any
    assert off.status_code == 403 and "no scrape token yet" in off.json()["detail"]
    assert scrape(agent).status_code == 200
    for wrong in ({"params": {"token": "x" * 32}}, {"headers": {"Authorization": "Bearer " + "x" * 32}}, {}):
        refused = requests.get(url, timeout=5, **wrong)  # type: ignore[arg-type]
        assert refused.status_code == 401 and "job" not in refused.text
        assert refused.headers["WWW-Authenticate"].startswith("Bearer")


def test_apply_builds_keeps_rebuilds_and_drops(agent: Agent) -> None:
    first = stages(generation=1)
    assert agent.apply_assignments(first) is True
    assert states(agent) == {"job-stage-0": (1, "ready"), "job-stage-1": (1, "ready")}
    built = {s.assignment.stage_id: s for s in agent.registry.stages()}

    assert agent.apply_assignments(first) is False  # same desired state: nothing rebuilt
    assert {s.assignment.stage_id: s for s in agent.registry.stages()} == built

    first_generation = {stage_id: weakref.ref(stage) for stage_id, stage in built.items()}
    mailbox = built["job-stage-1"].mailbox
    del built  # the agent frees what it drops once no call holds it
    second = stages(generation=2)
    assert agent.apply_assignments(second[:1]) is True  # new generation of stage 0; stage 1 no longer listed
    assert states(agent) == {"job-stage-0": (2, "ready")}
    assert all(stage() is None for stage in first_generation.values())
    with pytest.raises(Exception, match="no longer hosted"):
        mailbox.put((0, "ACTIVATION", 0), torch.zeros(1))  # dropped stages are closed

    assert agent.apply_assignments([]) is True
    assert agent.observed() == []


def wait_in_mailbox(stage: HostedStage, woken: threading.Event) -> None:
    """What a RunStep waiting for an activation does; it unwinds slowly once the stage is closed."""
    try:
        stage.mailbox.get((0, "ACTIVATION", 0), timeout=30.0)
    except MailboxClosed:
        woken.set()
    time.sleep(0.5)


def test_a_drop_waits_until_a_call_running_in_the_stage_lets_go_of_it(agent: Agent) -> None:
    agent.apply_assignments(stages()[:1])
    [stage] = agent.registry.stages()
    runtime = weakref.ref(stage.runtime)
    woken = threading.Event()
    call = threading.Thread(target=wait_in_mailbox, args=(stage, woken))
    call.start()
    del stage  # the running call holds the only other reference

    assert agent.apply_assignments(stages(generation=2)[:1]) is True
    # The old weights were gone before the new generation was built, not merely when the call ended.
    assert woken.is_set() and runtime() is None
    call.join()


def test_a_stage_over_the_owners_memory_budget_is_refused_with_what_it_needs(agent: Agent) -> None:
    # 64·1024 + 1024 parameters trained by plain SGD: a weight and a gradient, 8 bytes each.
    [stage] = stages(model={"layer_sizes": [64, 1024, 10]})[:1]
    assert (stage.optimizer.name, stage.optimizer.momentum) == ("sgd", 0.0)
    # Its state, plus the stash of its in-flight micro-batches (GPipe's: all of them; each keeps its input and the
    # ReLU's output), one more micro-batch's that the heap keeps without recompute (`heap_kept_bytes`), and the
    # backward's gradients of the layer's own stash (its input).
    per_micro_batch = stage.max_micro_batch_size * 4 * (64 + 1024)
    stash = (stage.micro_batches + 1) * per_micro_batch + stage.max_micro_batch_size * 4 * 64
    need = 8 * (64 * 1024 + 1024) + stash
    agent.registry.runtime_bytes = 5_000  # what the agent held before any stage counts too
    agent.registry.memory_budget = need + 5_000 - 1
    assert agent.apply_assignments([stage]) is True
    [observed] = agent.observed()
    assert observed["state"] == "failed" and not agent.registry.stages()
    assert f"needs {need:,} bytes" in observed["message"] and "beside the 5,000 this agent holds" in observed["message"]
    assert f"above the {need + 5_000 - 1:,} bytes this node's owner offers" in observed["message"]
    agent.registry.memory_budget = need + 5_000  # the next generation fits the owner's new budget
    agent.apply_assignments([Assignment.from_json({**stage.to_json(), "generation": 2})])
    assert [o["state"] for o in agent.observed()] == ["ready"]


def test_unbuildable_and_duplicate_stages_are_reported_failed(agent: Agent) -> None:
    huge = stages(job_id="huge", model={"layer_sizes": [1_000_000, 1_000_000, 4]})[:1]  # 4 TB of weights
    good = stages()[:1]
    duplicate = Assignment.from_json({**good[0].to_json(), "stage_id": "other-id"})
    rejected = [ObservedStage("broken", 3, "failed", "invalid assignment: ...")]
    assert agent.apply_assignments(good + huge + [duplicate], rejected) is True
    observed = {o["stage_id"]: o for o in agent.observed()}
    assert observed["job-stage-0"]["state"] == "ready"
    assert observed["huge-stage-0"]["state"] == "failed"
    assert "could not build the stage" in observed["huge-stage-0"]["message"]
    assert observed["other-id"]["state"] == "failed"
    assert "already hosted here as job-stage-0" in observed["other-id"]["message"]
    assert observed["broken"] == {
        "stage_id": "broken",
        "generation": 3,
        "state": "failed",
        "message": "invalid assignment: ...",
    }
    # A failed stage is not rebuilt on every sync of the same generation.
    assert agent.apply_assignments(good + huge + [duplicate], rejected) is False


def test_a_new_assignment_cannot_take_the_slot_of_a_running_stage(agent: Agent) -> None:
    good = stages()[:1]
    agent.apply_assignments(good)
    duplicate = Assignment.from_json({**good[0].to_json(), "stage_id": "other-id"})
    agent.apply_assignments([duplicate, *good])  # listed first, still the newcomer
    assert states(agent) == {"job-stage-0": (1, "ready"), "other-id": (1, "failed")}


def test_stage_metrics_follow_assignments(agent: Agent) -> None:
    agent.apply_assignments(stages())
    text = scrape(agent).text
    assert "arceus_stage_assigned 2.0" in text
    assert 'arceus_stage_info{job_id="job",replica="",stage_index="1"} 1.0' in text
    assert "arceus_heartbeat_age_seconds NaN" in text
    assert "arceus_replica_micro_batches_total{" not in text  # no replicated stage here
    agent.apply_assignments([])
    text = scrape(agent).text
    assert "arceus_stage_assigned 0.0" in text and "arceus_stage_info{" not in text


def test_replica_metrics_follow_assignments_and_count_by_stage_and_replica(agent: Agent) -> None:
    """A replicated stage's replica is exported by its stage and replica id from its assignment on (at 0 before its
    first step), counts what its steps report, and goes with its assignment."""
    [[first], [second]] = replicated_pipeline_assignments(
        job_id="job", model_config=MODEL, boundaries=[0, 1, 2], addresses=[["127.0.0.1:1"], ["127.0.0.1:2"]],
        optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=2, max_micro_batch_size=4,
    )
    second = {**second, "stage_id": "job-stage-1-replica-5", "replica": 5}
    agent.apply_assignments([Assignment.from_json(first), Assignment.from_json(second)])
    text = scrape(agent).text
    assert 'arceus_stage_info{job_id="job",replica="5",stage_index="1"} 1.0' in text
    for name in ("arceus_replica_micro_batches_total", "arceus_replica_samples_total",
                 "arceus_replica_compute_seconds_total"):
        assert f'{name}{{replica="0",stage="0"}} 0.0' in text and f'{name}{{replica="5",stage="1"}} 0.0' in text
    agent.metrics.replica_step(1, 5, samples=12, micro_batches=3, compute_seconds=0.5)
    text = scrape(agent).text
    assert 'arceus_replica_micro_batches_total{replica="5",stage="1"} 3.0' in text
    assert 'arceus_replica_samples_total{replica="5",stage="1"} 12.0' in text
    assert 'arceus_replica_compute_seconds_total{replica="5",stage="1"} 0.5' in text
    agent.apply_assignments([Assignment.from_json(first)])
    text = scrape(agent).text
    assert 'replica="5"' not in text and 'arceus_replica_micro_batches_total{replica="0",stage="0"} 0.0' in text
    agent.metrics.replica_step(1, 5, samples=4, micro_batches=1, compute_seconds=0.1)  # a step ending after its drop
    assert 'replica="5"' not in scrape(agent).text


def test_served_stages_follow_assignments(agent: Agent) -> None:
    with driver_channel(agent) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        request = stage_pb2.GetStateRequest(target=stage_pb2.StageRef(job_id="job", stage_index=1, generation=1))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.GetState(request, timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # no stage here knows the job's driver yet
        agent.apply_assignments(stages())
        state = decode_checkpoint(b"".join(chunk.data for chunk in stub.GetState(request, timeout=5)))
        assert sorted(state) == ["layers.1.bias", "layers.1.weight"]


@pytest.mark.parametrize("address", ["localhost", "host:port", "host:70000"])
def test_bad_listen_address(address: str) -> None:
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        split_host_port(address)
    assert split_host_port("[::1]:50051") == ("[::1]", 50051)


@pytest.mark.parametrize("failed_attempts", [0, 2])
def test_save_state_uploads_the_stage_state_to_the_control_plane(control_plane, failed_attempts: int) -> None:  # noqa: ANN001
    """Also when the control plane fails the first attempts (a 5xx: its database restarting under a request):
    the file is sent again, afresh, and the reply names what arrived."""
    control_plane.failed_uploads = failed_attempts
    client = ControlPlaneClient(control_plane.url, control_plane.token)
    agent = Agent(device=torch.device("cpu"), upload_state=client.upload_state)
    agent.start()
    try:
        agent.apply_assignments(stages())
        target = stage_pb2.StageRef(job_id="job", stage_index=1, generation=1)
        with driver_channel(agent) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            request = stage_pb2.SaveStateRequest(target=target, include_optimizer_state=True, upload_path="/up/1")
            reply = stub.SaveState(request, timeout=10)
            streamed = b"".join(c.data for c in stub.GetState(stage_pb2.GetStateRequest(target=target), timeout=10))
            outside = stage_pb2.SaveStateRequest(target=target, upload_path="http://elsewhere.example/x")
            with pytest.raises(grpc.RpcError) as info:
                stub.SaveState(outside, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a path on the control plane" in info.value.details()
    finally:
        agent.stop(grace=1)
    uploaded = control_plane.uploads["/up/1"]
    assert [path for path, _, _ in control_plane.requests].count("/up/1") == failed_attempts + 1
    assert uploaded == streamed  # the file GetState would have streamed, sent to the control plane instead
    assert (reply.sha256, reply.size_bytes) == (checkpoint_digest(uploaded), len(uploaded))
    assert sorted(decode_checkpoint(uploaded)) == ["layers.1.bias", "layers.1.weight"]


def test_save_state_without_a_control_plane_is_refused(agent: Agent) -> None:
    agent.apply_assignments(stages())
    with driver_channel(agent) as channel:
        request = stage_pb2.SaveStateRequest(
            target=stage_pb2.StageRef(job_id="job", stage_index=1, generation=1), upload_path="/up/1"
        )
        with pytest.raises(grpc.RpcError) as info:
            stage_pb2_grpc.StageServiceStub(channel).SaveState(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "without a control plane" in info.value.details()
