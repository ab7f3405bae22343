"""Compressed transfers and bf16 compute over real agents: int8 activations and gradients train the MLP
about as well as fp32 while the stages send at least 3.5x fewer bytes; top-k gradients with error feedback
still learn; bf16 autocast trains like fp32 (its spot checks: test_training_audit.py).

Three `python -m nodeagent` processes host one job per setting (same seed, same batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import StageEndpoint, TrainPlan, TrainResult
from arceus.training.recording import RecordingSink
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, identity_for, pipeline_assignments

pytestmark = pytest.mark.slow

# Wide enough that int8 blocks of 64 hold whole rows: [32, 128] and [32, 64] activations per micro-batch.
MODEL = {"type": "mlp", "layer_sizes": [64, 128, 64, 10]}
BOUNDARIES = [0, 1, 2, 3]
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}
MICRO_BATCHES = 2
STEPS = 90  # two epochs
TRANSFERS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "int8": {"activations": "int8", "gradients": "int8", "block_size": 64},
    "topk": {"activations": "bf16", "gradients": "topk", "topk_ratio": 0.25},
    "bf16-compute": {},
}
PRECISION = {"bf16-compute": "bf16"}  # the others compute in fp32
Results = dict[str, tuple[TrainResult, list[float]]]  # job id -> (result, per-step losses)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Results]:
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    per_agent: list[list[dict[str, Any]]] = [[], [], []]
    for job_id, transfer in TRANSFERS.items():
        stages = pipeline_assignments(
            job_id=job_id, model_config=MODEL, boundaries=BOUNDARIES, addresses=addresses, optimizer=OPTIMIZER,
            seed=3, micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
            transfer=transfer, precision=PRECISION.get(job_id, "fp32"),
        )
        for i, stage in enumerate(stages):
            per_agent[i].append(stage)
    agents: list[AgentProcess] = spawn_static_agents(per_agent, addresses, tmp_path_factory.mktemp("agents"))
    try:
        out = {}
        for job_id in TRANSFERS:
            plan = TrainPlan(
                job_id=job_id, generation=1, credential=driver_token(job_id, 1),
                stages=tuple(StageEndpoint(i, a.grpc_address, f"agent-{i}", BOUNDARIES[i], BOUNDARIES[i + 1],
                    certificate=identity_for(a.grpc_address).certificate)
                             for i, a in enumerate(agents)),
                dataset=DATASET, epochs=2, learning_rate=OPTIMIZER["lr"], micro_batches=MICRO_BATCHES, seed=3,
                rpc_timeout_seconds=30.0, max_steps=STEPS, precision=PRECISION.get(job_id, "fp32"),
            )
            recorder = RecordingSink()
            out[job_id] = (train(plan, recorder), [p.loss for p in recorder.steps])
        yield out
    finally:
        stop_agents(agents)


def _tail_loss(losses: list[float]) -> float:
    return sum(losses[-15:]) / 15  # the last steps' mean: one step's loss is noisy


def _bytes_sent(result: TrainResult) -> int:
    return sum(stage.bytes_sent for stage in result.stages)  # activations and gradients between stages


def test_int8_trains_like_fp32_with_at_least_3_5x_fewer_bytes(results: Results) -> None:
    fp32, fp32_losses = results["fp32"]
    int8, int8_losses = results["int8"]
    assert fp32_losses[-1] < fp32_losses[0] / 4  # the reference run really learned
    assert abs(_tail_loss(int8_losses) - _tail_loss(fp32_losses)) <= 0.02 * _tail_loss(fp32_losses) + 0.005
    assert abs(int8.val_loss - fp32.val_loss) <= 0.02 * fp32.val_loss + 0.005
    assert _bytes_sent(fp32) / _bytes_sent(int8) >= 3.5
    # receivers count encoded bytes too: the last stage gets int8 activations (and the driver's labels)
    assert fp32.stages[2].bytes_received / int8.stages[2].bytes_received >= 3


def test_topk_gradients_with_error_feedback_still_learn(results: Results) -> None:
    fp32, _ = results["fp32"]
    topk, losses = results["topk"]
    assert _tail_loss(losses) < losses[0] / 3
    assert topk.val_loss < 2 * fp32.val_loss
    assert _bytes_sent(fp32) / _bytes_sent(topk) >= 2


def test_bf16_compute_trains_like_fp32(results: Results) -> None:
    fp32, fp32_losses = results["fp32"]
    bf16, bf16_losses = results["bf16-compute"]
    assert bf16_losses != fp32_losses  # the stages really computed in bf16
    assert abs(_tail_loss(bf16_losses) - _tail_loss(fp32_losses)) <= 0.05 * _tail_loss(fp32_losses) + 0.01
    assert bf16.val_accuracy >= fp32.val_accuracy - 0.02
