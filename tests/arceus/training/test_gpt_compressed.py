"""The issue's 8-bit acceptance on a GPT: with int8 activations and gradients between two real agents,
validation loss after the same steps stays within 2% of fp32, and the stages send ≥ 3.5x fewer bytes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from arceus.contracts.assignment import max_micro_batch_size
from arceus.training.driver import train
from arceus.training.plan import StageEndpoint, TrainPlan, TrainResult
from arceus.training.recording import RecordingSink
from devtools.launch import free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, identity_for, pipeline_assignments

pytestmark = pytest.mark.slow

MODEL = {"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 16}
BOUNDARIES = [0, 2, 4]  # embedding + block 1 | block 2 + head
MICRO_BATCHES, SEED, STEPS = 4, 5, 44  # two epochs of the text below, each ending in validation
ADAM = {"name": "adam", "lr": 3e-3, "weight_decay": 0.0}
TRANSFERS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "int8": {"activations": "int8", "gradients": "int8", "block_size": 64},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, small_text) -> Iterator[dict[str, TrainResult]]:
    model, dataset = small_text(MODEL)
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    per_agent: list[list[dict[str, Any]]] = [[], []]
    for job_id, transfer in TRANSFERS.items():
        stages = pipeline_assignments(
            job_id=job_id, model_config=model, boundaries=BOUNDARIES, addresses=addresses, optimizer=ADAM,
            seed=SEED, micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(dataset, MICRO_BATCHES),
            transfer=transfer,
        )
        for i, stage in enumerate(stages):
            per_agent[i].append(stage)
    agents = spawn_static_agents(per_agent, addresses, tmp_path_factory.mktemp("gpt-agents"))
    try:
        out = {}
        for job_id in TRANSFERS:
            plan = TrainPlan(
                job_id=job_id, generation=1, credential=driver_token(job_id, 1),
                stages=tuple(StageEndpoint(i, a.grpc_address, f"agent-{i}", BOUNDARIES[i], BOUNDARIES[i + 1],
                    certificate=identity_for(a.grpc_address).certificate)
                             for i, a in enumerate(agents)),
                dataset=dataset, epochs=2, learning_rate=ADAM["lr"], micro_batches=MICRO_BATCHES, seed=SEED,
                rpc_timeout_seconds=30.0, max_steps=STEPS, model=model,
            )
            out[job_id] = train(plan, RecordingSink())
        yield out
    finally:
        stop_agents(agents)


def test_int8_gpt_validation_loss_within_two_percent_with_3_5x_fewer_bytes(results: dict[str, TrainResult]) -> None:
    fp32, int8 = results["fp32"], results["int8"]
    assert fp32.steps == int8.steps == STEPS
    assert abs(int8.val_loss - fp32.val_loss) <= 0.02 * fp32.val_loss
    sent = {name: sum(stage.bytes_sent for stage in r.stages) for name, r in results.items()}
    assert sent["fp32"] >= 3.5 * sent["int8"] > 0
