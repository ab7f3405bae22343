"""A CNN trained across real agent processes equals single-process training, per step, to fp32 rounding.

Three `python -m nodeagent` processes hold the digits CNN (conv | conv | head) one layer each, so the
boundaries carry [B, C, H, W] images; the reference is plain torch on the same batches. Every step's loss,
the validation loss and the final weights must agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.model.registry import fit_model_to_dataset
from arceus.training.driver import train
from arceus.training.plan import TrainPlan
from arceus.training.recording import RecordingSink
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, pipeline_assignments, stage_endpoints
from devtools.reference import fetch_weights
from tests.arceus.training.reference_jobs import reference_of

pytestmark = pytest.mark.slow

# Standardised pixels (digits are in [0, 1], mean 0.3): the small CNN learns visibly within STEPS.
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32, "normalize": {"mean": 0.3, "std": 0.38}})
# The model config as job submission completes it: input_shape [1, 8, 8] and 10 classes from digits.
_, MODEL, _ = fit_model_to_dataset({"type": "convnet", "channels": [4, 8]}, DATASET)
BOUNDARIES = [0, 1, 2, 3]
MICRO_BATCHES = 4
SEED = 7
STEPS = 20
RUNS: dict[str, dict[str, Any]] = {
    "cnn-sgd": {"name": "sgd", "lr": 0.15, "momentum": 0.9, "weight_decay": 1e-4},
    "cnn-adam": {"name": "adam", "lr": 0.02, "weight_decay": 0.0},
}


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[AgentProcess]]:
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    per_agent: list[list[dict[str, Any]]] = [[], [], []]
    for job_id, optimizer in RUNS.items():
        stages = pipeline_assignments(
            job_id=job_id,
            model_config=MODEL,
            boundaries=BOUNDARIES,
            addresses=addresses,
            optimizer=optimizer,
            seed=SEED,
            micro_batches=MICRO_BATCHES,
            max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
        )
        for i, stage in enumerate(stages):
            per_agent[i].append(stage)
    started = spawn_static_agents(per_agent, addresses, tmp_path_factory.mktemp("cnn-agents"))
    try:
        yield started
    finally:
        stop_agents(started)


@pytest.mark.parametrize("job_id", list(RUNS))
def test_cnn_pipeline_training_matches_single_process(agents: list[AgentProcess], job_id: str) -> None:
    optimizer = RUNS[job_id]
    plan = TrainPlan(
        job_id=job_id,
        generation=1, credential=driver_token(job_id, 1),
        stages=stage_endpoints([a.grpc_address for a in agents], BOUNDARIES),
        dataset=DATASET,
        epochs=1,
        learning_rate=optimizer["lr"],
        micro_batches=MICRO_BATCHES,
        seed=SEED,
        rpc_timeout_seconds=30.0,
        max_steps=STEPS,
        schedule="gpipe",
    )
    recorder = RecordingSink()
    result = train(plan, recorder)
    expected = reference_of(MODEL, DATASET, optimizer, epochs=1, seed=SEED, max_steps=STEPS)

    assert result.steps == STEPS and not result.stopped
    losses = [p.loss for p in recorder.steps]
    for step, (got, want) in enumerate(zip(losses, expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: pipeline loss {got!r} != reference {want!r}"
    assert math.isclose(losses[0], math.log(10), rel_tol=0.05)  # ten classes, about uniform at first
    assert expected.val_loss < math.log(10) - 0.5  # it actually learned something
    assert math.isclose(result.val_loss, expected.val_loss, rel_tol=1e-5)
    assert math.isclose(result.val_accuracy, expected.val_accuracy, rel_tol=1e-5)

    weights = fetch_weights(plan)
    assert sorted(weights) == sorted(expected.weights)
    for name, want in expected.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
