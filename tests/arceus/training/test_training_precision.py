"""bf16 autocast over real agents: a 3-stage MLP trains about as well as in fp32 (spot checks of bf16
stages: tests/arceus/training/test_training_audit.py).

Three `python -m nodeagent` processes host one job per precision (same seed, same batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from arceus.data import validate_dataset_config
from arceus.training import StageEndpoint, TrainPlan, TrainResult, max_micro_batch_size, train
from arceus.training.recording import RecordingSink
from nodeagent.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from nodeagent.static import pipeline_assignments

pytestmark = pytest.mark.slow

MODEL = {"type": "mlp", "layer_sizes": [64, 128, 64, 10]}
BOUNDARIES = [0, 1, 2, 3]
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}
MICRO_BATCHES = 2
STEPS = 90  # two epochs
PRECISIONS = ("fp32", "bf16")
Results = dict[str, tuple[TrainResult, list[float]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Results]:
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    per_agent: list[list[dict[str, Any]]] = [[], [], []]
    for precision in PRECISIONS:
        stages = pipeline_assignments(
            job_id=precision, model_config=MODEL, boundaries=BOUNDARIES, addresses=addresses, optimizer=OPTIMIZER,
            seed=3, micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
            precision=precision,
        )
        for i, stage in enumerate(stages):
            per_agent[i].append(stage)
    agents: list[AgentProcess] = spawn_static_agents(per_agent, addresses, tmp_path_factory.mktemp("agents"))
    try:
        out = {}
        for precision in PRECISIONS:
            plan = TrainPlan(
                job_id=precision, generation=1,
                stages=tuple(StageEndpoint(i, a.grpc_address, f"agent-{i}", BOUNDARIES[i], BOUNDARIES[i + 1])
                             for i, a in enumerate(agents)),
                dataset=DATASET, epochs=2, learning_rate=OPTIMIZER["lr"], micro_batches=MICRO_BATCHES, seed=3,
                rpc_timeout_seconds=30.0, max_steps=STEPS, precision=precision,
            )
            recorder = RecordingSink()
            out[precision] = (train(plan, recorder), [p.loss for p in recorder.steps])
        yield out
    finally:
        stop_agents(agents)


def test_bf16_trains_like_fp32(results: Results) -> None:
    fp32, fp32_losses = results["fp32"]
    bf16, bf16_losses = results["bf16"]
    assert fp32_losses[-1] < fp32_losses[0] / 4  # the reference run really learned
    assert bf16_losses != fp32_losses  # the stages really computed in bf16
    tail = sum(bf16_losses[-15:]) / 15, sum(fp32_losses[-15:]) / 15
    assert abs(tail[0] - tail[1]) <= 0.05 * tail[1] + 0.01
    assert bf16.val_accuracy >= fp32.val_accuracy - 0.02
