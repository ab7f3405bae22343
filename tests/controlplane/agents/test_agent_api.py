"""The node-agent protocol: node-token auth, register, heartbeat and the Assignment contract."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.assignment import Assignment
from arceus.contracts.data_plane import NEIGHBOUR_STREAM, link_streamed
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.credentials import job_stage_credentials
from controlplane.jobs.models import Job, Stage
from controlplane.nodes.models import Node
from controlplane.nodes.serializers import AssignmentOutput
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for, rank_credentials
from tests.controlplane.conftest import agent_register

pytestmark = pytest.mark.django_db

CAPABILITIES = {"device_type": "cpu", "device_name": "Test CPU", "memory_bytes": 8 * 2**30, "flops_fp32": 5e10}


def agent_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    return client


@pytest.fixture
def agent(user) -> tuple[Node, APIClient]:
    node, token = node_create(owner=user, name="agent")
    return node, agent_client(token)


def register(client: APIClient, address: str = "127.0.0.1:50051", **caps: Any) -> Any:
    top = {name: caps.pop(name) for name in ("metrics_port", "data_plane") if name in caps}
    body = {"grpc_address": address, "capabilities": {**CAPABILITIES, **caps},
            "tls_certificate": identity_for(address).certificate, **top}
    return agent_register(client, body)


def heartbeat(client: APIClient, observed: list[dict[str, Any]] | None = None) -> Any:
    return client.post("/api/agent/heartbeat", {"observed": observed or []}, format="json")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "node agent endpoint: send `Authorization: Node <token>`"),
        ("Node wrong-token", "invalid node token: no node has it"),
        ("Node", "malformed node credentials"),
        ("Node a b", "malformed node credentials"),
    ],
)
def test_agent_endpoints_need_a_valid_node_token(db: None, header: str | None, message: str) -> None:
    client = APIClient()
    if header:
        client.credentials(HTTP_AUTHORIZATION=header)
    for path in ("/api/agent/register", "/api/agent/heartbeat"):
        response = client.post(path, {}, format="json")
        assert response.status_code == 401
        assert response.json()["detail"].startswith(message)
        assert response["WWW-Authenticate"] == "Node"


def test_a_user_token_is_not_a_node_token(api: APIClient) -> None:
    assert register(api).status_code == 401


def test_register_records_capabilities(agent: tuple[Node, APIClient]) -> None:
    node, client = agent
    response = register(client, runtime_bytes=300 * 2**20, metrics_port=9400)
    assert response.status_code == 200
    assert response.json() == {"node_id": str(node.id), "heartbeat_interval_seconds": 2.0}
    node.refresh_from_db()
    assert node.runtime_memory_bytes == 300 * 2**20
    assert node.metrics_port == 9400
    assert (node.device_type, node.memory_bytes, node.flops_fp32, node.grpc_address) == (
        "cpu",
        8 * 2**30,
        5e10,
        "127.0.0.1:50051",
    )
    assert (node.ready_status, node.ready_reason) == ("Unknown", "Registered")
    assert node.lease.duration_seconds == 6.0
    assert node.data_plane == []  # declared nothing: an agent older than the data-plane features
    assert register(client, data_plane=["rdma", NEIGHBOUR_STREAM]).status_code == 200
    node.refresh_from_db()
    assert node.data_plane == [NEIGHBOUR_STREAM, "rdma"]  # a later version's feature is kept, sorted


@pytest.mark.parametrize(
    ("address", "caps", "field"),
    [
        ("127.0.0.1", {}, "grpc_address"),
        ("127.0.0.1:0", {}, "grpc_address"),
        ("127.0.0.1:70000", {}, "grpc_address"),
        ("0.0.0.0:50051", {}, "grpc_address"),
        ("bad host!:50051", {}, "grpc_address"),
        ("127.0.0.1:50051", {"device_type": "tpu"}, "capabilities.device_type"),
        ("127.0.0.1:50051", {"memory_bytes": 0}, "capabilities.memory_bytes"),
        ("127.0.0.1:50051", {"memory_bytes": "8GB"}, "capabilities.memory_bytes"),
        ("127.0.0.1:50051", {"flops_fp32": 0}, "capabilities.flops_fp32"),
        ("127.0.0.1:50051", {"flops_fp32": -1.5}, "capabilities.flops_fp32"),
        ("127.0.0.1:50051", {"runtime_bytes": -1}, "capabilities.runtime_bytes"),
        ("127.0.0.1:50051", {"runtime_bytes": 8 * 2**30}, "capabilities.runtime_bytes"),  # all of its memory
        ("127.0.0.1:50051", {"metrics_port": 0}, "metrics_port"),
        ("127.0.0.1:50051", {"metrics_port": 65536}, "metrics_port"),
        ("127.0.0.1:50051", {"metrics_port": "9400/x"}, "metrics_port"),
        ("127.0.0.1:50051", {"data_plane": "neighbour_stream"}, "data_plane"),
        ("127.0.0.1:50051", {"data_plane": ["Neighbour Stream"]}, "data_plane"),
        ("127.0.0.1:50051", {"data_plane": [NEIGHBOUR_STREAM, NEIGHBOUR_STREAM]}, "data_plane"),
    ],
)
def test_register_validates_strictly(agent: tuple[Node, APIClient], address: str, caps: dict, field: str) -> None:
    node, client = agent
    response = register(client, address, **caps)
    assert response.status_code == 400
    assert list(response.json()["errors"]) == [field]
    node.refresh_from_db()
    assert not node.is_registered


def test_ipv6_and_hostnames_are_addresses(agent: tuple[Node, APIClient]) -> None:
    _, client = agent
    assert register(client, "[::1]:50051").status_code == 200
    assert register(client, "gpu-box.local:50051").status_code == 200


def test_heartbeat_before_register_is_a_409(agent: tuple[Node, APIClient]) -> None:
    response = heartbeat(agent[1])
    assert response.status_code == 409
    assert "POST /api/agent/register before heartbeating" in response.json()["detail"]


def test_heartbeat_marks_the_node_ready_and_nudges_the_reconciler_only_on_change(
    agent: tuple[Node, APIClient], django_capture_on_commit_callbacks
) -> None:
    node, client = agent
    register(client)
    with django_capture_on_commit_callbacks() as first:
        response = heartbeat(client)
    assert response.status_code == 200
    version = response.json()["assignments_version"]
    assert response.json() == {
        "node_id": str(node.id),
        "assignments_version": version,
        "assignments": [],
        "step_grants": {},  # no job hosted
        "controls": {"max_threads": None, "max_memory_bytes": None},
        "heartbeat_interval_seconds": 2.0,
        "relay": None,  # dialled directly
        "relays": [],
        "relay_certificate": None,
        "metrics_token_sha256": None,  # the operator set no metrics token: nobody may scrape the agent
    }
    node.refresh_from_db()
    assert (node.ready_status, node.ready_reason) == ("True", "AgentReady")
    assert len(first) == 1  # Ready changed: nudge
    with django_capture_on_commit_callbacks() as steady:
        heartbeat(client)
    assert steady == []  # nothing changed: no message


def three_agents(user, first: int = 1) -> list[tuple[Node, APIClient]]:  # noqa: ANN001
    """Three registered, heartbeating nodes at 10.0.0.<first>.. (each address its own agent's key)."""
    agents = []
    for i in range(3):
        node, token = node_create(owner=user, name=f"agent-{i}")
        client = agent_client(token)
        assert register(client, f"10.0.0.{first + i}:5005{i}").status_code == 200
        assert heartbeat(client).status_code == 200
        agents.append((node, client))
    return agents


def test_heartbeat_returns_the_assignment_contract(user, queued_job) -> None:
    agents = three_agents(user)
    job = queued_job()
    reconcile_once()
    job.refresh_from_db()
    by_index = {s.index: s for s in Stage.objects.filter(job=job)}
    addresses = {i: s.node.grpc_address for i, s in by_index.items()}
    for node, client in agents:
        [assignment] = heartbeat(client).json()["assignments"]
        index = assignment["stage_index"]
        assert by_index[index].node_id == node.id
        assert assignment == {
            "stage_id": f"{job.id}-stage-{index}",
            "job_id": str(job.id),
            "stage_index": index,
            "num_stages": 3,
            "generation": job.generation,
            "model": {"type": "mlp", "layer_sizes": [64, 32, 16, 10]},
            "layer_start": index,
            "layer_end": index + 1,
            "seed": 3,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0001},
            "micro_batches": 4,
            "transfer": {"activations": "fp32", "gradients": "fp32", "block_size": 64, "topk_ratio": 0.1},
            "precision": "fp32",
            "activation_checkpointing": False,
            "schedule": "gpipe",
            "max_micro_batch_size": 90,  # ceil(max(32, 360) / 4)
            "prev_address": addresses.get(index - 1),
            "next_address": addresses.get(index + 1),
            "credentials": job_stage_credentials(
                job_id=str(job.id), generation=job.generation, stage_index=index, rank=0, ranks=[1, 1, 1]
            ).to_json(),
            "certificates": {
                addresses[i]: identity_for(addresses[i]).certificate for i in (index - 1, index + 1) if i in addresses
            },
            "checkpoint": None,
        }
        # The agent's own parser accepts it.
        assert Assignment.from_json(assignment).stage_index == index


def test_each_assignment_names_the_data_plane_features_of_its_agent_and_neighbours_and_both_ends_agree(
    user, queued_job,  # noqa: ANN001
) -> None:
    """Agents 0 and 1 declare a neighbour stream, agent 2 (an older version) nothing: it is sent no `data_plane`
    (its parser refuses a field it does not know), its neighbours see it declared none, and every link's two ends
    reach the same transport from their own assignments."""
    declared = {}
    for i in range(3):
        node, token = node_create(owner=user, name=f"agent-{i}")
        client = agent_client(token)
        features = [NEIGHBOUR_STREAM] if i < 2 else []
        assert register(client, f"10.0.0.{i + 1}:5005{i}", **({"data_plane": features} if features else {})
                        ).status_code == 200
        assert heartbeat(client).status_code == 200
        declared[node.id] = (client, features)
    job = queued_job()
    reconcile_once()
    by_index = {s.index: s.node_id for s in Stage.objects.filter(job=job)}
    assignments = {}
    for index, node_id in by_index.items():
        client, features = declared[node_id]
        [assignment] = heartbeat(client).json()["assignments"]
        neighbour = {end: declared[by_index[j]][1] if j in by_index else []
                     for end, j in (("prev", index - 1), ("next", index + 1))}
        if features:
            assert assignment["data_plane"] == {"own": features, **neighbour}
        else:
            assert "data_plane" not in assignment
        assignments[index] = Assignment.from_json(assignment).data_plane
    for lower in range(2):
        both = all(declared[by_index[i]][1] for i in (lower, lower + 1))
        assert link_streamed(assignments[lower].own, assignments[lower].next) == both
        assert link_streamed(assignments[lower + 1].prev, assignments[lower + 1].own) == both


def test_the_jobs_transfer_and_precision_settings_reach_every_assignment(user, queued_job) -> None:
    agents = three_agents(user)
    queued_job(transfer={"activations": "int8", "gradients": "topk", "topk_ratio": 0.25}, precision="bf16")
    reconcile_once()
    for _, client in agents:
        [assignment] = heartbeat(client).json()["assignments"]
        parsed = Assignment.from_json(assignment)
        assert (parsed.transfer.activations, parsed.transfer.gradients) == ("int8", "topk")
        assert (parsed.transfer.block_size, parsed.transfer.topk_ratio) == (64, 0.25)
        assert parsed.precision == "bf16"


def test_observed_states_count_only_for_the_current_generation(user, queued_job) -> None:
    agents = three_agents(user)
    job = queued_job()
    reconcile_once()
    job.refresh_from_db()
    node, client = agents[0]
    stage = Stage.objects.get(node=node)
    stale = {"stage_id": stage.stage_id, "generation": job.generation - 1, "state": "ready", "message": ""}
    heartbeat(client, [stale, {"stage_id": "garbage", "generation": 1, "state": "ready"}])
    stage.refresh_from_db()
    assert stage.observed_state == "pending" and stage.observed_generation is None
    heartbeat(client, [{**stale, "generation": job.generation, "state": "failed", "message": "out of memory"}])
    stage.refresh_from_db()
    assert (stage.observed_generation, stage.observed_state, stage.observed_message) == (
        job.generation,
        "failed",
        "out of memory",
    )


def test_heartbeat_validates_observed(agent: tuple[Node, APIClient]) -> None:
    _, client = agent
    register(client)
    response = heartbeat(client, [{"stage_id": "x", "generation": -1, "state": "exploded"}])
    assert response.status_code == 400
    assert set(response.json()["errors"]) == {"observed[0].generation", "observed[0].state"}


def test_the_whole_flow_to_a_running_job(user, queued_job, django_capture_on_commit_callbacks) -> None:
    agents = three_agents(user)
    job = queued_job()
    reconcile_once()
    for _, client in agents:
        [assignment] = heartbeat(client).json()["assignments"]
        observed = [{"stage_id": assignment["stage_id"], "generation": assignment["generation"], "state": "ready"}]
        heartbeat(client, observed)
    with django_capture_on_commit_callbacks() as enqueued:
        report = reconcile_once()
    assert [type(a).__name__ for a in report.applied] == ["StartDriver"]
    assert len(enqueued) == 1  # the training task
    job.refresh_from_db()
    assert job.status == "running" and job.started_at is not None


@pytest.mark.parametrize("status", ["placing", "running"])
def test_an_agent_that_re_registers_rewinds_its_job_and_keeps_its_stage(user, queued_job, status) -> None:
    agents = three_agents(user)
    job = queued_job()
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status=status, driver_lease_owner="d", driver_lease_expires_at=timezone.now())
    job.refresh_from_db()
    placed, generation = dict(Stage.objects.filter(job=job).values_list("index", "node_id")), job.generation
    node, client = agents[1]
    index = Stage.objects.get(node=node).index
    register(client, "10.0.0.9:6000")  # a new process, perhaps on a new port: its stage's state is gone
    reconcile_once()  # the pass the registration nudged
    job.refresh_from_db()
    assert (job.status, job.generation) == ("placing", generation + 1)
    assert job.driver_lease_owner == ""  # the old driver's writes are refused from now on
    training = next(c for c in job.conditions if c["type"] == "Training")
    assert training["reason"] == "NodeRestarted"
    assert f"agent-1 restarted while hosting stage {index}" in training["message"]
    assert dict(Stage.objects.filter(job=job).values_list("index", "node_id")) == placed
    assert set(Stage.objects.filter(job=job).values_list("generation", flat=True)) == {generation + 1}


def test_the_documented_assignment_is_the_contract() -> None:
    """The OpenAPI schema's Assignment (a documenting serializer) names exactly what the contract sends."""
    split = Assignment.from_json({
        "stage_id": "00000000-0000-0000-0000-000000000000-stage-0-rank-1",
        "job_id": "00000000-0000-0000-0000-000000000000", "stage_index": 0, "num_stages": 2, "generation": 1,
        "model": {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 8, "block_size": 4, "vocab_size": 5},
        "layer_start": 0, "layer_end": 2, "seed": 0, "optimizer": {"name": "adam", "lr": 0.001},
        "micro_batches": 2, "max_micro_batch_size": 4, "prev_address": None, "next_address": "b:1",
        "tensor_parallel": {"rank": 1, "size": 2, "peers": ["a:1", "a:2"]},
        "credentials": rank_credentials("j", 1, 0, 1, [2, 1]).to_json(),
        "certificates": {address: identity_for(address).certificate for address in ("a:1", "b:1")},
        "checkpoint": {"step": 3, "url": "/x", "sha256": "0" * 64},
        "data_plane": {"own": [NEIGHBOUR_STREAM], "prev": [], "next": []},
    })
    sent = split.to_json()
    documented = AssignmentOutput().fields
    assert set(documented) == set(sent)
    for name in ("optimizer", "credentials", "checkpoint", "transfer", "tensor_parallel", "data_plane"):
        assert set(documented[name].fields) == set(sent[name]), name


def test_re_registering_counts_as_a_restart_and_fails_the_job_once_they_run_out(user, queued_job, settings) -> None:
    """An agent cannot replay (and be paid for) the same steps forever by re-registering before each checkpoint."""
    settings.ARCEUS_JOB_MAX_RESTARTS = 2
    agents = three_agents(user)
    job = queued_job()
    reconcile_once()
    _, client = agents[1]
    for restarts in (1, 2):
        register(client)
        reconcile_once()  # the pass the registration nudged
        job.refresh_from_db()
        assert (job.status, job.restarts) == ("placing", restarts)
    register(client)
    reconcile_once()
    job.refresh_from_db()
    assert job.status == "failed"
    failed = next(c for c in job.conditions if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "restarted 2 times without saving a checkpoint" in failed["message"]


def test_an_agent_re_registering_too_often_is_flagged_and_its_owner_sees_why(user, queued_job, settings, api) -> None:
    """Re-registering before every checkpoint, in one job or across jobs, makes the node unplaceable."""
    settings.ARCEUS_NODE_MAX_RESTARTS = 1
    agents = three_agents(user)
    job = queued_job()
    reconcile_once()
    node, client = agents[1]
    idle, idle_token = node_create(owner=user, name="idle")  # hosts nothing
    for _ in range(5):  # its registrations lose no work and count nothing
        assert register(agent_client(idle_token), "10.0.0.4:50053").status_code == 200
    assert register(client).status_code == 200  # one restart while hosting: allowed
    assert Node.objects.get(pk=node.pk).flagged_at is None
    assert register(client).status_code == 200
    reconcile_once()  # the pass the registrations nudged
    [shown] = [n for n in api.get("/api/nodes").json() if n["id"] == str(node.id)]
    assert shown["flag"]["reason"].startswith("restarted 2 times while hosting a stage within 3600 s")
    assert Node.objects.get(pk=idle.pk).flagged_at is None
    assert not Stage.objects.filter(job=job, node=node).exists()


def test_a_restarted_agent_is_sent_nothing_of_its_stage_until_the_job_rewinds(user, queued_job) -> None:  # noqa: ANN001
    """Between its registration and the reconciler's pass a fresh process must not rebuild its stage at the generation
    its neighbours trained past (the driver would still accept it)."""
    agents = three_agents(user)
    job = queued_job()
    reconcile_once()
    _, client = agents[1]
    register(client)
    assert heartbeat(client).json()["assignments"] == []
    reconcile_once()
    [assignment] = heartbeat(client).json()["assignments"]
    assert assignment["generation"] == Job.objects.get(pk=job.pk).generation
