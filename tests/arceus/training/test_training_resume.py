"""Resuming from a checkpoint is exact: the same losses, data order and weights as a run never stopped.

Run A trains 50 steps across three agent processes, checkpointing every 20. Three fresh agent
processes then load A's checkpoint of step 40 (weights and optimizer state, as safetensors files)
and run B resumes there: steps 41-50 (which cross the end of epoch 1 at step 45) must match A's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from arceus.checkpoint import StateFile, checkpoint_digest
from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import StageEndpoint, TrainPlan
from arceus.training.recording import RecordingSink
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, identity_for, pipeline_assignments
from devtools.reference import fetch_weights

pytestmark = pytest.mark.slow

MODEL = {"type": "mlp", "layer_sizes": [64, 96, 32, 10]}
BOUNDARIES = [0, 1, 2, 3]
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES, SEED, STEPS, INTERVAL, RESUME_AT = 4, 11, 50, 20, 40
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adam": {"name": "adam", "lr": 0.003, "weight_decay": 0.0},
    "sgd": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
}


def spawn(job_ids: dict[str, dict[str, Any]], generation: int, directory: Path) -> list[AgentProcess]:
    """Three agents, each hosting one stage of every job in `job_ids` (job id -> {optimizer, checkpoints})."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    per_agent: list[list[dict[str, Any]]] = [[], [], []]
    for job_id, job in job_ids.items():
        stages = pipeline_assignments(
            job_id=job_id,
            model_config=MODEL,
            boundaries=BOUNDARIES,
            addresses=addresses,
            optimizer=job["optimizer"],
            seed=SEED,
            micro_batches=MICRO_BATCHES,
            max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
            generation=generation,
        )
        for i, stage in enumerate(stages):
            stage["checkpoint"] = job.get("checkpoints", [None] * 3)[i]
            per_agent[i].append(stage)
    return spawn_static_agents(per_agent, addresses, directory)


def plan(job_id: str, agents: list[AgentProcess], generation: int, start_step: int, lr: float) -> TrainPlan:
    return TrainPlan(
        job_id=job_id,
        generation=generation, credential=driver_token(job_id, generation),
        stages=tuple(
            StageEndpoint(i, a.grpc_address, f"agent-{i}", BOUNDARIES[i], BOUNDARIES[i + 1],
                certificate=identity_for(a.grpc_address).certificate)
            for i, a in enumerate(agents)
        ),
        dataset=DATASET,
        epochs=5,
        learning_rate=lr,
        micro_batches=MICRO_BATCHES,
        seed=SEED,
        rpc_timeout_seconds=30.0,
        max_steps=STEPS,
        start_step=start_step,
        checkpoint_interval=INTERVAL,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[RecordingSink, dict]]]:
    agents = spawn({name: {"optimizer": opt} for name, opt in OPTIMIZERS.items()}, 1, tmp_path_factory.mktemp("a"))
    try:
        runs = {}
        for name, opt in OPTIMIZERS.items():
            recorder = RecordingSink()
            train(plan(name, agents, 1, 0, opt["lr"]), recorder)
            runs[name] = (recorder, fetch_weights(plan(name, agents, 1, 0, opt["lr"])))
        yield runs
    finally:
        stop_agents(agents)


@pytest.fixture(scope="module")
def resumed(
    uninterrupted: dict[str, tuple[RecordingSink, dict]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[RecordingSink, dict]]]:
    jobs: dict[str, dict[str, Any]] = {}
    for name, opt in OPTIMIZERS.items():
        refs = [
            {"step": RESUME_AT, "url": str(stage.path), "sha256": checkpoint_digest(stage.path.read_bytes())}
            for stage in uninterrupted[name][0].checkpoints[RESUME_AT]
        ]
        jobs[name] = {"optimizer": opt, "checkpoints": refs}
    agents = spawn(jobs, 2, tmp_path_factory.mktemp("b"))
    try:
        runs = {}
        for name, opt in OPTIMIZERS.items():
            recorder = RecordingSink()
            train(plan(name, agents, 2, RESUME_AT, opt["lr"]), recorder)
            runs[name] = (recorder, fetch_weights(plan(name, agents, 2, RESUME_AT, opt["lr"])))
        yield runs
    finally:
        stop_agents(agents)


def test_checkpoints_are_taken_every_interval_and_at_the_end(uninterrupted) -> None:
    for recorder, _ in uninterrupted.values():
        assert sorted(recorder.checkpoints) == [20, 40, 50]
        for stage in recorder.checkpoints[40]:
            assert any(name.startswith("optimizer.") for name in StateFile(stage.path))  # optimizer state travels
            assert stage.sha256 == checkpoint_digest(stage.path.read_bytes())
            assert stage.size_bytes == stage.path.stat().st_size


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_resumed_run_continues_exactly_where_the_checkpoint_left_off(uninterrupted, resumed, name) -> None:
    (a, weights_a), (b, weights_b) = uninterrupted[name], resumed[name]
    assert [p.step for p in b.steps] == list(range(RESUME_AT + 1, STEPS + 1))
    assert [p.epoch for p in b.steps] == [1] * 5 + [2] * 5
    for got, want in zip(b.steps, a.steps[RESUME_AT:], strict=True):
        assert math.isclose(got.loss, want.loss, rel_tol=1e-6), (got.step, got.loss, want.loss)
    # Epoch 1 ends inside the resumed range: its validation matches too.
    assert [(r.epoch, round(r.val_loss, 6)) for r in b.epochs] == [(r.epoch, round(r.val_loss, 6)) for r in a.epochs]
    assert sorted(weights_b) == sorted(weights_a)
    for key, want in weights_a.items():
        torch.testing.assert_close(weights_b[key], want, rtol=1e-6, atol=1e-7)
