"""The backbone: fp32 pipeline training across three agent processes equals single-process training.

Three real `python -m nodeagent` processes hold the MLP [64, 128, 64, 10] one layer each and talk
gRPC on loopback; the reference is plain torch on the same batches. Every step's loss and the final
weights must agree to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import TrainPlan
from arceus.training.recording import RecordingSink
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, pipeline_assignments, stage_endpoints
from devtools.reference import fetch_weights
from tests.arceus.training.reference_jobs import reference_of

pytestmark = pytest.mark.slow

MODEL = {"type": "mlp", "layer_sizes": [64, 128, 64, 10]}
BOUNDARIES = [0, 1, 2, 3]
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES = 4
SEED = 7
STEPS = 50  # crosses the first epoch's end (45 steps), so validation and reshuffling are covered
RUNS: dict[str, dict[str, Any]] = {
    "sgd-gpipe": {
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
        "schedule": "gpipe",
    },
    "adam-gpipe": {"optimizer": {"name": "adam", "lr": 0.003, "weight_decay": 0.0}, "schedule": "gpipe"},
    "sgd-1f1b": {
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
        "schedule": "1f1b",
    },
}


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[AgentProcess]]:
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    per_agent: list[list[dict[str, Any]]] = [[], [], []]
    for job_id, run in RUNS.items():
        stages = pipeline_assignments(
            job_id=job_id,
            model_config=MODEL,
            boundaries=BOUNDARIES,
            addresses=addresses,
            optimizer=run["optimizer"],
            seed=SEED,
            micro_batches=MICRO_BATCHES,
            max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
        )
        for i, stage in enumerate(stages):
            per_agent[i].append(stage)
    started = spawn_static_agents(per_agent, addresses, tmp_path_factory.mktemp("parity-agents"))
    try:
        yield started
    finally:
        stop_agents(started)


@pytest.mark.parametrize("job_id", list(RUNS))
def test_pipeline_training_matches_single_process(agents: list[AgentProcess], job_id: str) -> None:
    run = RUNS[job_id]
    plan = TrainPlan(
        job_id=job_id,
        generation=1, credential=driver_token(job_id, 1),
        stages=stage_endpoints([a.grpc_address for a in agents], BOUNDARIES),
        dataset=DATASET,
        epochs=5,
        learning_rate=run["optimizer"]["lr"],
        micro_batches=MICRO_BATCHES,
        seed=SEED,
        rpc_timeout_seconds=30.0,
        max_steps=STEPS,
        schedule=run["schedule"],
    )
    recorder = RecordingSink()
    result = train(plan, recorder)
    expected = reference_of(MODEL, DATASET, run["optimizer"], epochs=5, seed=SEED, max_steps=STEPS)
    expected_losses, expected_weights, expected_val_loss = expected.losses, expected.weights, expected.val_loss

    assert result.steps == STEPS and not result.stopped
    assert [p.step for p in recorder.steps] == list(range(1, STEPS + 1))
    assert [p.epoch for p in recorder.steps] == [1] * 45 + [2] * 5
    assert [r.epoch for r in recorder.epochs] == [1, 2]  # after epoch 1, and where max_steps stopped
    for step, (got, want) in enumerate(
        zip([p.loss for p in recorder.steps], expected_losses, strict=True), 1
    ):
        assert math.isclose(got, want, rel_tol=1e-5), (
            f"step {step}: pipeline loss {got!r} != reference {want!r}"
        )
    assert math.isclose(result.val_loss, expected_val_loss, rel_tol=1e-5)
    assert expected_losses[-1] < expected_losses[0]  # it actually learned something

    weights = fetch_weights(plan)
    assert sorted(weights) == sorted(expected_weights)
    for name, want in expected_weights.items():
        torch.testing.assert_close(
            weights[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )

    # Every stage reports its share of the work: all forward samples, and bytes both ways where it has
    # neighbours (the driver's inputs count as received bytes of stage 0).
    samples = STEPS * DATASET["batch_size"] - 2  # the 45th batch of epoch 1 holds 30 samples
    val_samples = 2 * 359
    for stage in result.stages:
        assert stage.samples == samples + val_samples
        assert stage.bytes_received > 0 and stage.compute_seconds > 0
    assert result.stages[0].bytes_sent > 0 and result.stages[1].bytes_sent > 0

    # Each step, each stage says how it spent the step: computing, and waiting for inputs and sends (the bubble).
    # The last stage cannot start before the others' forwards reach it, so it always waits.
    for p in recorder.steps:
        assert [t.index for t in p.timings] == [0, 1, 2]
        assert all(t.compute_seconds > 0 and t.wait_seconds >= 0 for t in p.timings)
    assert all(p.timings[2].wait_seconds > 0 for p in recorder.steps)
    # The agents export the same as Prometheus metrics: a counter and a per-step histogram.
    for agent in agents:
        text = requests.get(f"http://{agent.metrics_address}/metrics", params={"token": agent.metrics_token},
                            timeout=5).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        [waited] = families["arceus_stage_wait_seconds"].samples  # the counter's _total
        assert waited.value > 0
        counts = [s for s in families["arceus_stage_step_wait_seconds"].samples
                  if s.name.endswith("_count") and s.labels["mode"] == "train"]
        assert counts and counts[0].value >= STEPS
