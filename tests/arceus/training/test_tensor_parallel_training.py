"""A GPT whose stage is a tensor-parallel group of agent processes trains like single-process torch.

Three `python -m nodeagent` processes: a 2-stage pipeline whose stage 1 (block 2 and the head) is split
over two agents, 4 of the 8 heads each, and a 1-stage job split over two agents. Per-step loss matches
plain torch to 1e-5 over 24 steps (an epoch end: validation runs through the split stage too), and the
weights and checkpoints the driver gathers from the ranks are the unsplit model's, under its names.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from arceus.checkpoint import StateFile
from arceus.contracts.assignment import max_micro_batch_size
from arceus.safetensors_file import OPTIMIZER_PREFIX
from arceus.training.driver import Pipeline, train
from arceus.training.plan import RankEndpoint, StageEndpoint, TrainPlan
from arceus.training.recording import RecordingSink
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import certificates_for, driver_token, pipeline_assignments, rank_credentials
from devtools.reference import fetch_weights
from tests.arceus.training.reference_jobs import reference_of

pytestmark = pytest.mark.slow

MODEL = {"type": "transformer", "n_layer": 2, "n_head": 8, "d_model": 32, "block_size": 16}
MICRO_BATCHES = 4
SEED = 5
STEPS = 24  # an epoch is 22 steps (337 windows of the first 6000 characters, batches of 16)
ADAM = {"name": "adam", "lr": 3e-3, "weight_decay": 0.0}
SGD = {"name": "sgd", "lr": 0.3, "momentum": 0.9, "weight_decay": 1e-4}
# job -> layer boundaries, the agents hosting each stage (several: a tensor-parallel group), schedule,
# optimizer. Agents: 0, 1, 2.
RUNS: dict[str, dict[str, Any]] = {
    "tp-pipeline": {"boundaries": [0, 2, 4], "agents": [[0], [1, 2]], "schedule": "1f1b", "optimizer": SGD},
    "tp-only": {"boundaries": [0, 4], "agents": [[2, 0]], "schedule": "gpipe", "optimizer": ADAM},
    "tp-bf16": {
        "boundaries": [0, 2, 4], "agents": [[2], [0, 1]], "schedule": "gpipe", "optimizer": ADAM, "precision": "bf16"
    },
}
FP32_RUNS = [job_id for job_id, run in RUNS.items() if run.get("precision", "fp32") == "fp32"]


def split_assignments(
    run: dict[str, Any], job_id: str, model: dict[str, Any], dataset: dict[str, Any], addresses: list[str]
) -> list[tuple[int, dict[str, Any]]]:
    """(agent, assignment) for every rank of every stage: one-agent stage assignments, with a group's
    ranks given `tensor_parallel` and their neighbours pointed at every rank."""
    ranks = [[addresses[agent] for agent in agents] for agents in run["agents"]]
    stages = pipeline_assignments(
        job_id=job_id,
        model_config=model,
        boundaries=run["boundaries"],
        addresses=[r[0] for r in ranks],
        optimizer=run["optimizer"],
        seed=SEED,
        micro_batches=MICRO_BATCHES,
        max_micro_batch_size=max_micro_batch_size(dataset, MICRO_BATCHES),
        precision=run.get("precision", "fp32"),
    )
    placed = []
    for i, stage in enumerate(stages):
        for key, neighbour in (("prev_address", i - 1), ("next_address", i + 1)):
            if 0 <= neighbour < len(ranks) and len(ranks[neighbour]) > 1:
                stage[key] = ranks[neighbour]
        neighbours = [a for j in (i - 1, i + 1) if 0 <= j < len(ranks) for a in ranks[j]]
        for rank, agent in enumerate(run["agents"][i]):
            own = {
                "credentials": rank_credentials(job_id, 1, i, rank, [len(r) for r in ranks]).to_json(),
                "certificates": certificates_for(
                    [*neighbours, *(a for r, a in enumerate(ranks[i]) if r != rank and len(ranks[i]) > 1)]
                ),
            }
            if len(ranks[i]) == 1:
                placed.append((agent, {**stage, **own}))
            else:
                split = {"rank": rank, "size": len(ranks[i]), "peers": ranks[i]}
                stage_id = f"{stage['stage_id']}-rank-{rank}"
                placed.append((agent, {**stage, **own, "stage_id": stage_id, "tensor_parallel": split}))
    return placed


@pytest.fixture(scope="module")
def configs(small_text) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and dataset configs as job submission completes them (vocab_size, block_size)."""
    return small_text(MODEL)


@pytest.fixture(scope="module")
def agents(
    configs: tuple[dict[str, Any], dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[AgentProcess]]:
    model, dataset = configs
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    per_agent: list[list[dict[str, Any]]] = [[], [], []]
    for job_id, run in RUNS.items():
        for agent, assignment in split_assignments(run, job_id, model, dataset, addresses):
            per_agent[agent].append(assignment)
    started = spawn_static_agents(per_agent, addresses, tmp_path_factory.mktemp("tp-agents"))
    try:
        yield started
    finally:
        stop_agents(started)


def plan_for(job_id: str, agents: list[AgentProcess], model: dict[str, Any], dataset: dict[str, Any]) -> TrainPlan:
    run = RUNS[job_id]
    boundaries, hosts = run["boundaries"], run["agents"]
    return TrainPlan(
        job_id=job_id,
        generation=1, credential=driver_token(job_id, 1),
        stages=tuple(
            StageEndpoint(
                index=i,
                address=agents[hosts[i][0]].grpc_address,
                node_id=f"agent-{hosts[i][0]}",
                layer_start=boundaries[i],
                layer_end=boundaries[i + 1],
                certificate=agents[hosts[i][0]].certificate,
                tensor_parallel_ranks=tuple(
                    RankEndpoint(address=agents[a].grpc_address, node_id=f"agent-{a}",
                        certificate=agents[a].certificate)
                    for a in hosts[i][1:]
                ),
            )
            for i in range(len(hosts))
        ),
        dataset=dataset,
        epochs=3,
        learning_rate=run["optimizer"]["lr"],
        micro_batches=MICRO_BATCHES,
        seed=SEED,
        rpc_timeout_seconds=30.0,
        max_steps=STEPS,
        schedule=run["schedule"],
        model=model,
    )


def rank_weights(plan: TrainPlan, stage: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's own parameters of a split stage."""
    with Pipeline(plan) as pipeline, tempfile.TemporaryDirectory() as directory:
        paths = [Path(directory) / f"rank-{rank}" for rank in range(len(pipeline.ranks[stage]))]
        for client, path in zip(pipeline.ranks[stage], paths, strict=True):
            client.save_state(path, include_optimizer_state=False)
        return [dict(StateFile(path)) for path in paths]


@pytest.mark.parametrize("job_id", FP32_RUNS)
def test_a_tensor_parallel_stage_trains_like_single_process_torch(
    configs: tuple[dict[str, Any], dict[str, Any]], agents: list[AgentProcess], job_id: str
) -> None:
    model, dataset = configs
    run = RUNS[job_id]
    boundaries, hosts = run["boundaries"], run["agents"]
    plan = plan_for(job_id, agents, model, dataset)
    recorder = RecordingSink()
    result = train(plan, recorder)
    expected = reference_of(model, dataset, run["optimizer"], epochs=3, seed=SEED, max_steps=STEPS)

    assert result.steps == STEPS and [r.epoch for r in recorder.epochs] == [1, 2]
    losses = [p.loss for p in recorder.steps]
    for step, (got, want) in enumerate(zip(losses, expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: pipeline loss {got!r} != reference {want!r}"
    assert losses[-1] < losses[0] - 0.3
    assert math.isclose(result.val_loss, expected.val_loss, rel_tol=1e-5)
    assert math.isclose(result.val_accuracy, expected.val_accuracy, rel_tol=1e-5)
    # Every agent is metered: each rank did the whole stage's micro-batches.
    assert sorted(s.node_id for s in recorder.steps[-1].stages) == sorted(f"agent-{a}" for h in hosts for a in h)

    # As in test_gpt_parity: Adam turns rounding noise of a zero gradient into lr-sized steps.
    atol = 1e-4 if run["optimizer"]["name"] == "adam" else 1e-6
    weights = fetch_weights(plan)
    assert sorted(weights) == sorted(expected.weights)
    for name, want in expected.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")

    # The final checkpoint of the split stage is the unsplit stage's file: whole tensors, unsplit names,
    # optimizer state included.
    split = len(hosts) - 1
    state = dict(StateFile(recorder.checkpoints[STEPS][split].path))
    stage_weights = {n: t for n, t in state.items() if not n.startswith(OPTIMIZER_PREFIX)}
    assert stage_weights.keys() == {n for n in expected.weights if int(n.split(".")[1]) >= boundaries[split]}
    for name, tensor in stage_weights.items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)
    c_attn = f"layers.{boundaries[-1] - 2}.attn.c_attn.weight"
    optimizer_state = {n for n in state if n.startswith(f"{OPTIMIZER_PREFIX}{c_attn}.")}
    assert optimizer_state
    assert all(state[n].shape in {torch.Size([]), weights[c_attn].shape} for n in optimizer_state)
    # ... gathered from ranks that each hold half the heads, and whose replicated parameters (LayerNorms,
    # biases after the reduce, head) stayed bitwise equal through training: their gradients were.
    rank0, rank1 = rank_weights(plan, split)
    assert rank1[c_attn].shape == (3 * model["d_model"] // 2, model["d_model"])
    replicated = [n for n in rank0 if rank0[n].shape == weights[n].shape]
    assert len(replicated) > len(rank0) // 2
    assert all(torch.equal(rank0[n], rank1[n]) for n in replicated)


def test_a_bf16_tensor_parallel_stage_trains_like_fp32_and_its_ranks_stay_identical(
    configs: tuple[dict[str, Any], dict[str, Any]], agents: list[AgentProcess]
) -> None:
    """bf16 autocast on every stage, stage 1 split over two agents: the ranks all-reduce bfloat16 partials in
    float32, so their replicated parameters stay bitwise equal through training, and the run tracks the
    fp32 single-process one as bf16 compute does (test_training_compressed.py: within 5%)."""
    model, dataset = configs
    plan = plan_for("tp-bf16", agents, model, dataset)
    recorder = RecordingSink()
    result = train(plan, recorder)
    expected = reference_of(model, dataset, ADAM, epochs=3, seed=SEED, max_steps=STEPS)

    losses = [p.loss for p in recorder.steps]
    assert result.steps == STEPS and len(losses) == len(expected.losses)
    assert not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, expected.losses, strict=True))  # bf16
    assert losses[-1] < losses[0] - 0.3
    assert abs(losses[-1] - expected.losses[-1]) <= 0.05 * expected.losses[-1]
    assert abs(result.val_loss - expected.val_loss) <= 0.05 * expected.val_loss
    rank0, rank1 = rank_weights(plan, 1)
    c_attn = f"layers.{RUNS['tp-bf16']['boundaries'][-1] - 2}.attn.c_attn.weight"
    assert rank0[c_attn].shape == rank1[c_attn].shape == (3 * model["d_model"] // 2, model["d_model"])
    replicated = [n for n in rank0 if rank0[n].shape == expected.weights[n].shape]
    assert len(replicated) > len(rank0) // 2
    assert all(torch.equal(rank0[n], rank1[n]) for n in replicated)
