"""Replicated stages (arceus/swarm) over real agent processes train like one process on the same global batch.

Six `python -m nodeagent` processes host each replica of each stage of an MLP (3 stages x 2 replicas, SGD;
2, 1, 3 replicas with Adam; one stage x 3, SGD; 4 micro-batches: not divisible by 3) and of a small GPT (3 x 2,
SGD; one stage x 3, Adam). Every step each
micro-batch goes through the replicas its route names, the replicas of a stage exchange their gradients over
ReplicaService and apply the same optimizer step. Losses and final weights equal plain torch on the same
batches to fp32 rounding (the standard of the unreplicated parity tests), every replica takes at least one
micro-batch each step, and the replicas of a stage hold the same bits (weights and optimizer state) after every
step.
"""

from __future__ import annotations

import math
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.model.registry import model_spec_from_config
from arceus.training.driver import train
from arceus.training.plan import StepProgress, TrainPlan
from arceus.training.recording import RecordingSink
from arceus.training.stage_client import StageClient
from arceus.v1 import replica_pb2, replica_pb2_grpc, stage_pb2
from arceus.wire.channels import open_channel
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import (
    driver_token,
    identity_for,
    rank_credentials,
    replica_credentials,
    replica_endpoints,
    replicated_pipeline_assignments,
)
from devtools.reference import fetch_weights
from tests.arceus.training.reference_jobs import reference_of

pytestmark = pytest.mark.slow

MLP = {"type": "mlp", "layer_sizes": [64, 128, 64, 10]}
GPT = {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 16}
DIGITS = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES = 4
SEED = 7
AGENTS = 6
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
ADAM = {"name": "adam", "lr": 0.003, "weight_decay": 0.0}
# Each run: the model, its stage boundaries, which agents host each stage's replicas 0, 1, ..., and steps.
RUNS: dict[str, dict[str, Any]] = {
    "mlp-3x2-sgd": {"model": MLP, "boundaries": [0, 1, 2, 3], "agents": [[0, 1], [2, 3], [4, 5]], "optimizer": SGD,
                    "schedule": "gpipe", "steps": 6},
    "mlp-2-1-3-adam": {"model": MLP, "boundaries": [0, 1, 2, 3], "agents": [[0, 1], [2], [3, 4, 5]],
                       "optimizer": ADAM, "schedule": "1f1b", "steps": 6},
    "gpt-3x2-sgd": {"model": GPT, "boundaries": [0, 1, 3, 4], "agents": [[5, 4], [3, 2], [1, 0]],
                    "optimizer": {"name": "sgd", "lr": 0.3, "momentum": 0.9, "weight_decay": 1e-4},
                    "schedule": "1f1b", "steps": 4, "digests": False},
    # One stage of 3 replicas, 4 micro-batches a step (not divisible by 3).
    "mlp-1x3-sgd": {"model": MLP, "boundaries": [0, 3], "agents": [[1, 3, 5]], "optimizer": SGD,
                    "schedule": "gpipe", "steps": 4},
    # Weights to 1e-5 absolute: attention's key bias has no gradient but rounding (softmax ignores it), which Adam
    # divides by its own size, so replicas summing in another order than one process move it by ~1e-6.
    "gpt-1x3-adam": {"model": GPT, "boundaries": [0, 4], "agents": [[0, 2, 4]], "optimizer": ADAM,
                     "schedule": "1f1b", "steps": 4, "atol": 1e-5},
}
# Replicas that sync every H steps (DiLoCo): not one process's training, so apart from RUNS.
SYNC_RUNS: dict[str, dict[str, Any]] = {
    "mlp-3x2-sgd-sync3": {**RUNS["mlp-3x2-sgd"], "replica_sync": {"every_steps": 3, "outer_lr": 0.7}},
}


@pytest.fixture(scope="module")
def gpt_configs(small_text) -> tuple[dict[str, Any], dict[str, Any]]:
    return small_text(GPT)


def configs(job_id: str, gpt_configs: tuple[dict[str, Any], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    return gpt_configs if {**RUNS, **SYNC_RUNS}[job_id]["model"] is GPT else (MLP, DIGITS)


@pytest.fixture(scope="module")
def addresses(
    gpt_configs: tuple[dict[str, Any], dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, list[list[str]]]]:
    """Each run's replica addresses; every agent hosts at most one replica of each run's stages."""
    ports = [f"127.0.0.1:{port}" for port in free_ports(AGENTS)]
    per_agent: list[list[dict[str, Any]]] = [[] for _ in range(AGENTS)]
    by_run = {}
    for job_id, run in {**RUNS, **SYNC_RUNS}.items():
        model, dataset = configs(job_id, gpt_configs)
        by_run[job_id] = [[ports[a] for a in stage] for stage in run["agents"]]
        stages = replicated_pipeline_assignments(
            job_id=job_id, model_config=model, boundaries=run["boundaries"], addresses=by_run[job_id],
            optimizer=run["optimizer"], seed=SEED, micro_batches=MICRO_BATCHES,
            max_micro_batch_size=max_micro_batch_size(dataset, MICRO_BATCHES), schedule=run["schedule"],
            replica_sync=run.get("replica_sync"),
        )
        for stage, agents in zip(stages, run["agents"], strict=True):
            for assignment, agent in zip(stage, agents, strict=True):
                per_agent[agent].append(assignment)
    started: list[AgentProcess] = spawn_static_agents(
        per_agent, ports, tmp_path_factory.mktemp("replica-agents"), ready_timeout=240.0
    )
    try:
        yield by_run
    finally:
        stop_agents(started)


class DigestingSink(RecordingSink):
    """Records progress and, after every step, the SHA-256 of every replica's state (weights and optimizer)."""

    def __init__(self, plan: TrainPlan, digests: bool) -> None:
        """`digests` False: none (a replica then applies each step's update when the next step begins, not when
        GetState reads it)."""
        super().__init__()
        self.clients = [
            StageClient(e, job_id=plan.job_id, generation=plan.generation, credential=plan.credential, timeout=30.0)
            for e in plan.replicas
        ] if digests else []
        self.digests: list[dict[tuple[int, int], str]] = []

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        if not self.clients:
            return
        with tempfile.TemporaryDirectory() as directory:
            self.digests.append({
                (c.endpoint.index, c.endpoint.replica): c.save_state(Path(directory) / "state")[0]
                for c in self.clients
            })

    def close(self) -> None:
        for client in self.clients:
            client.close()


def _plan(job_id: str, run: dict[str, Any], dataset: dict[str, Any], addresses: list[list[str]]) -> TrainPlan:
    stages, replicas = replica_endpoints(addresses, run["boundaries"])
    return TrainPlan(
        job_id=job_id, generation=1, credential=driver_token(job_id, 1), stages=stages, replicas=replicas,
        dataset=dataset, epochs=1, learning_rate=run["optimizer"]["lr"], micro_batches=MICRO_BATCHES, seed=SEED,
        rpc_timeout_seconds=30.0, max_steps=run["steps"], schedule=run["schedule"],
    )


def _exchanged_bytes(model: dict[str, Any], run: dict[str, Any], elements_per_parameter: int) -> int:
    """The tensor bytes a step's exchange pushes: each stage's R replicas reduce-scatter and all-gather its
    vector (the gradients, or weight deltas and optimizer state), 2 (R - 1) vectors' worth of float32."""
    sizes = model_spec_from_config(model).layer_params()
    bounds = run["boundaries"]
    return sum(
        2 * (len(agents) - 1) * 4 * elements_per_parameter * sum(sizes[bounds[i] : bounds[i + 1]])
        for i, agents in enumerate(run["agents"])
    )


@pytest.mark.parametrize("job_id", list(RUNS))
def test_replicated_training_matches_single_process(
    addresses: dict[str, list[list[str]]], gpt_configs: tuple[dict[str, Any], dict[str, Any]], job_id: str
) -> None:
    run, (model, dataset) = RUNS[job_id], configs(job_id, gpt_configs)
    plan = _plan(job_id, run, dataset, addresses[job_id])
    replicas = plan.replicas
    sink = DigestingSink(plan, run.get("digests", True))
    try:
        result = train(plan, sink)
    finally:
        sink.close()
    expected = reference_of(model, dataset, run["optimizer"], epochs=1, seed=SEED, max_steps=run["steps"])

    assert result.steps == run["steps"] and not result.stopped
    # The exact exchange carries every stage's gradients every step.
    assert [p.exchange_bytes for p in sink.steps] == [_exchanged_bytes(model, run, 1)] * run["steps"]
    for step, (got, want) in enumerate(zip([p.loss for p in sink.steps], expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: replicated loss {got!r} != reference {want!r}"
    assert expected.losses[-1] < expected.losses[0]
    assert math.isclose(result.val_loss, expected.val_loss, rel_tol=1e-5)
    weights = fetch_weights(plan)  # each stage's lowest replica
    assert sorted(weights) == sorted(expected.weights)
    for name, want in expected.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=run.get("atol", 1e-6),
                                   msg=lambda m, n=name: f"{n}: {m}")

    # The replicas of each stage hold the same bits after every step: weights and optimizer state.
    assert len(sink.digests) == (run["steps"] if run.get("digests", True) else 0)
    for step, digests in enumerate(sink.digests, 1):
        for index, stage in enumerate(run["agents"]):
            assert len({digests[(index, r)] for r in range(len(stage))}) == 1, f"step {step} stage {index}"
    # Every replica took at least one micro-batch every step (its micro-batch counter moved).
    before: dict[str, int] = {}
    for p in sink.steps:
        counted = {c.node_id: c.micro_batches for c in p.stages}
        assert set(counted) == {e.node_id for e in replicas}
        assert all(counted[node] > before.get(node, 0) for node in counted), f"step {p.step}: {counted}"
        before = counted
    # Each step's timings are each replica's own (what the dashboard shows): its node, and the micro-batches and
    # samples routed to it, which add up to the step's in every stage.
    for p in sink.steps:
        assert sorted(t.node_id for t in p.timings) == sorted(e.node_id for e in replicas)
        for index in range(len(run["agents"])):
            mine = [t for t in p.timings if t.index == index]
            assert sum(t.micro_batches for t in mine) == MICRO_BATCHES and min(t.micro_batches for t in mine) >= 1
            assert sum(t.samples for t in mine) == dataset["batch_size"] and all(t.compute_seconds > 0 for t in mine)


def test_replicas_syncing_every_h_steps_are_equal_after_each_sync(addresses: dict[str, list[list[str]]]) -> None:
    """replica_sync every 3 steps (DiLoCo): between syncs the replicas of a stage train apart on their own
    micro-batches and exchange nothing; at steps 3 and 6 they exchange their weight deltas and optimizer state
    (momentum buffers: twice the gradients' bytes) and leave the step with the same bits."""
    job_id = "mlp-3x2-sgd-sync3"
    run = SYNC_RUNS[job_id]
    plan = _plan(job_id, run, DIGITS, addresses[job_id])
    sink = DigestingSink(plan, digests=True)
    try:
        result = train(plan, sink)
    finally:
        sink.close()

    assert result.steps == run["steps"] and not result.stopped
    synced = _exchanged_bytes(MLP, run, 2)  # the weight deltas and SGD's momentum buffers
    assert [p.exchange_bytes for p in sink.steps] == [0, 0, synced, 0, 0, synced]
    # (What H costs in loss is bench/replica_sync.py's to measure: six steps of it are noise; the outer step's
    # arithmetic is tests/arceus/swarm/test_swarm_outer.py's.)
    assert all(math.isfinite(p.loss) for p in sink.steps)
    for step, digests in enumerate(sink.digests, 1):
        equal = [len({digests[(i, r)] for r in range(len(stage))}) == 1 for i, stage in enumerate(run["agents"])]
        if step % 3 == 0:
            assert all(equal), f"step {step}: a stage's replicas differ after a sync"
        else:
            assert not any(equal), f"step {step}: replicas trained apart, yet a stage's are equal"


def test_only_a_sibling_may_ask_a_replica_where_its_exchange_streams_are_taken(
    addresses: dict[str, list[list[str]]],
) -> None:
    """ExchangePort on stage 1 replica 0 of the 3x2 MLP: a stranger is not authenticated, the driver and the
    neighbouring stages' replicas are known but not allowed; a sibling learns the port (its stream is then judged by
    its certificate, its replica token and its epoch: tests/nodeagent/test_nodeagent_replicas.py)."""
    job_id = "mlp-3x2-sgd"
    address = addresses[job_id][1][0]
    request = replica_pb2.ExchangePortRequest(target=stage_pb2.StageRef(job_id=job_id, stage_index=1, generation=1))
    callers = {
        "stranger": (secrets.token_hex(32), grpc.StatusCode.UNAUTHENTICATED),
        "driver": (driver_token(job_id), grpc.StatusCode.PERMISSION_DENIED),
        "stage 0": (rank_credentials(job_id, 1, 0, 0, [1, 1, 1]).token, grpc.StatusCode.PERMISSION_DENIED),
        "stage 2": (rank_credentials(job_id, 1, 2, 0, [1, 1, 1]).token, grpc.StatusCode.PERMISSION_DENIED),
    }
    for caller, (token, code) in callers.items():
        channel = open_channel(address, token=token, certificate=identity_for(address).certificate)
        with channel, pytest.raises(grpc.RpcError) as info:
            replica_pb2_grpc.ReplicaServiceStub(channel).ExchangePort(request, timeout=30)
        assert info.value.code() == code, (caller, info.value.details())
        assert job_id not in (info.value.details() or ""), caller
    sibling = replica_credentials(job_id, 1, 1, 3)
    with open_channel(address, token=sibling.token, certificate=identity_for(address).certificate) as channel:
        assert replica_pb2_grpc.ReplicaServiceStub(channel).ExchangePort(request, timeout=30).port > 0
