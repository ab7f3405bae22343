"""Tensor-parallel jobs in the control plane: the `tensor_parallel` option is validated at submit (a 400
naming the field, nothing stored), a placement gives each rank its own node, every rank's agent gets an
assignment its parser accepts (its group and its neighbours' ranks), ranks report and move one by one."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.assignment import Assignment
from arceus.contracts.observed import ObservedStage
from controlplane.agents.services import node_heartbeat
from controlplane.controller.actions import PlaceJob, RewindJob, StartDriver
from controlplane.controller.estimate import job_estimate
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.services import job_start, job_submit
from controlplane.nodes.liveness import lease_renew

pytestmark = pytest.mark.django_db

MODEL = {"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 16}
GPT_JOB: dict[str, Any] = {
    "model_config": MODEL,
    "dataset_config": {"name": "text", "batch_size": 8},
    "optimizer": "adam",
    "learning_rate": 0.001,
    "micro_batches": 2,
    "stages": 2,
    "tensor_parallel": {"size": 2, "stages": [1]},
    "requirements": {"owner_diversity": False},  # the nodes here are all the user's
}


def submit(api: APIClient, **changes: Any) -> Any:
    return api.post("/api/jobs", {**GPT_JOB, **changes}, format="json")


def test_a_split_job_is_stored_normalised_without_spot_checks(api: APIClient) -> None:
    response = submit(api, tensor_parallel={"stages": [1], "size": 2})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["tensor_parallel"] == {"size": 2, "stages": [1]}
    assert body["audit_rate"] == 0.0  # the default for split jobs, which cannot be spot-checked yet
    every = submit(api, stages=None, tensor_parallel={"size": 4})
    assert every.status_code == 201, every.json()
    assert every.json()["tensor_parallel"] == {"size": 4}
    plain = submit(api, tensor_parallel={})
    assert (plain.json()["tensor_parallel"], plain.json()["audit_rate"]) == ({}, 0.05)
    mixed = submit(api, precision="bf16")  # the ranks all-reduce bf16 partials in float32
    assert mixed.status_code == 201, mixed.json()
    assert (mixed.json()["precision"], mixed.json()["tensor_parallel"]) == ("bf16", {"size": 2, "stages": [1]})


INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("an mlp", {"model_config": {"layer_sizes": [64, 10]}, "dataset_config": {"name": "digits"}, "stages": 1,
                "tensor_parallel": {"size": 2}}, "tensor_parallel", "only a transformer's or a llama's blocks split"),
    ("heads do not divide", {"tensor_parallel": {"size": 3}}, "tensor_parallel.size",
     "must divide the model's n_head (4) so each node takes whole attention heads; use one of 2, 4"),
    ("a group of one", {"tensor_parallel": {"size": 1}}, "tensor_parallel.size", "greater than or equal to 2"),
    ("no size", {"tensor_parallel": {"stages": [1]}}, "tensor_parallel.size", "required"),
    ("a misspelt key", {"tensor_parallel": {"size": 2, "stage": [1]}}, "tensor_parallel.stage", "Unknown field"),
    ("stages named but not counted", {"stages": None}, "tensor_parallel.stages", "set `stages` too"),
    ("a stage that does not exist", {"tensor_parallel": {"size": 2, "stages": [2]}}, "tensor_parallel.stages",
     "names stage 2 but the job has 2 stages (0-1)"),
    ("a stage twice", {"tensor_parallel": {"size": 2, "stages": [1, 1]}}, "tensor_parallel.stages", "listed once"),
    ("spot checks", {"audit_rate": 0.1}, "audit_rate", "cannot be spot-checked yet; use 0"),
    ("too few devices allowed", {"stages": None, "tensor_parallel": {"size": 2}, "requirements": {"max_devices": 1}},
     "requirements.max_devices", "a tensor-parallel stage alone needs 2 devices"),
    ("stage count against devices", {"requirements": {"max_devices": 2}}, "stages",
     "2 stages (3 devices) contradict requirements"),
]


@pytest.mark.parametrize(("case", "changes", "field", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_a_bad_split_is_a_400_naming_the_field_and_stores_nothing(
    api: APIClient, case: str, changes: dict[str, Any], field: str, message: str
) -> None:
    response = submit(api, **changes)
    assert response.status_code == 400, response.json()
    errors = response.json()["errors"]
    assert field in errors, errors
    assert message in " ".join(errors[field])
    assert Job.objects.count() == 0


def test_the_estimate_places_a_split_stage_on_a_group(user, ready_node) -> None:
    for name, flops in (("slow", 1e9), ("fast-a", 4e9), ("fast-b", 3e9)):
        ready_node(name, flops=flops)
    estimate = job_estimate(
        model_config=MODEL, dataset_config={"name": "text", "batch_size": 8}, epochs=1, micro_batches=2,
        schedule="gpipe", stages=2, requirements_config={"owner_diversity": False},
        tensor_parallel={"size": 2, "stages": [1]}, owner_id=user.id, now=timezone.now(), optimizer="adam",
        momentum=0.0, precision="fp32", activation_checkpointing=False,
    )
    assert estimate["feasible"], estimate["reason"]
    assert [(s["stage_index"], s["rank"], s["node_name"]) for s in estimate["stages"]] == [
        (0, 0, "slow"), (1, 0, "fast-a"), (1, 1, "fast-b")
    ]


def test_each_rank_gets_its_own_node_and_an_assignment_naming_its_group(user, ready_node) -> None:
    nodes = {name: ready_node(name, port=port, flops=flops)
             for name, port, flops in (("slow", 50051, 1e9), ("fast-a", 50052, 4e9), ("fast-b", 50053, 3e9))}
    job = job_start(job=job_submit(owner=user, **GPT_JOB))
    assert [type(a) for a in reconcile_once().applied] == [PlaceJob]
    job.refresh_from_db()
    rows = list(Stage.objects.filter(job=job).order_by("index", "rank"))
    assert [(r.index, r.rank, r.node.name) for r in rows] == [(0, 0, "slow"), (1, 0, "fast-a"), (1, 1, "fast-b")]
    assert [r.stage_id for r in rows] == [f"{job.id}-stage-0", f"{job.id}-stage-1", f"{job.id}-stage-1-rank-1"]
    group = ["127.0.0.1:50052", "127.0.0.1:50053"]

    now = timezone.now()
    assignments = {name: node_heartbeat(node=node, observed=[], now=now).assignments for name, node in nodes.items()}
    [first] = assignments["slow"]
    assert first["next_address"] == group and "tensor_parallel" not in first
    parsed = Assignment.from_json(first)
    assert parsed.next_addresses == tuple(group) and parsed.tensor_parallel is None
    for rank, name in enumerate(("fast-a", "fast-b")):
        [assignment] = assignments[name]
        assert assignment["tensor_parallel"] == {"rank": rank, "size": 2, "peers": group}
        assert assignment["prev_address"] == "127.0.0.1:50051" and assignment["num_stages"] == 2
        parsed = Assignment.from_json(assignment)
        assert (parsed.tensor_parallel.rank, parsed.sends_on) == (rank, rank == 0)

    # Every rank reports ready under its own stage id: then, and only then, the driver starts.
    for row in rows[:-1]:
        node_heartbeat(node=row.node, observed=[ObservedStage(row.stage_id, job.generation, "ready")], now=now)
    assert StartDriver not in {type(a) for a in reconcile_once().applied}
    last = rows[-1]
    node_heartbeat(node=last.node, observed=[ObservedStage(last.stage_id, job.generation, "ready")], now=now)
    assert [type(a) for a in reconcile_once().applied] == [StartDriver]


def test_a_lost_rank_alone_moves_and_the_group_gets_its_new_address(user, ready_node) -> None:
    for name, port, flops in (("slow", 50051, 1e9), ("fast-a", 50052, 4e9), ("fast-b", 50053, 3e9)):
        ready_node(name, port=port, flops=flops)
    job = job_start(job=job_submit(owner=user, **GPT_JOB))
    reconcile_once()
    spare = ready_node("spare", port=50054, flops=2e9)
    lost = Stage.objects.get(job=job, index=1, rank=1)
    lease_renew(node_id=lost.node_id, now=timezone.now() - timedelta(seconds=60))
    report = reconcile_once()
    assert RewindJob in {type(a) for a in report.applied}
    job.refresh_from_db()
    rows = list(Stage.objects.filter(job=job).order_by("index", "rank"))
    assert [(r.index, r.rank, r.node.name) for r in rows] == [(0, 0, "slow"), (1, 0, "fast-a"), (1, 1, "spare")]
    assert {r.generation for r in rows} == {job.generation}  # every rank rebuilds from the checkpoint
    [assignment] = node_heartbeat(node=rows[1].node, observed=[], now=timezone.now()).assignments
    assert assignment["tensor_parallel"]["peers"] == ["127.0.0.1:50052", "127.0.0.1:50054"]
    [assignment] = node_heartbeat(node=spare, observed=[], now=timezone.now()).assignments
    assert (assignment["stage_id"], assignment["tensor_parallel"]["rank"]) == (f"{job.id}-stage-1-rank-1", 1)
