from __future__ import annotations

import dataclasses

import pytest

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.errors import SpecError
from arceus.training.plan import StageEndpoint, TrainPlan
from devtools.pipeline import driver_token, identity_for


def endpoint(index: int, address: str, node_id: str, start: int, end: int) -> StageEndpoint:
    return StageEndpoint(index, address, node_id, start, end, certificate=identity_for(address).certificate)


PLAN = TrainPlan(
    job_id="j",
    generation=1, credential=driver_token("j", 1),
    stages=(endpoint(0, "127.0.0.1:1", "a", 0, 2), endpoint(1, "127.0.0.1:2", "b", 2, 3)),
    dataset=validate_dataset_config({"name": "digits"}),
    epochs=1,
    learning_rate=0.1,
    micro_batches=4,
    seed=0,
)


def test_a_valid_plan_passes() -> None:
    PLAN.check()


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"stages": ()}, "plan.stages", "at least one stage"),
        ({"stages": (endpoint(1, "h:1", "a", 0, 3),)}, "plan.stages", "indices must be 0..0"),
        (
            {"stages": (endpoint(0, "h:1", "a", 0, 2), endpoint(1, "h:2", "b", 1, 3))},
            "plan.stages",
            "contiguous, got [0, 2), [1, 3)",
        ),
        ({"epochs": 0}, "plan.epochs", "at least 1"),
        ({"micro_batches": 0}, "plan.micro_batches", "at least 1"),
        ({"learning_rate": float("nan")}, "plan.learning_rate", "positive number"),
        ({"rpc_timeout_seconds": 0.0}, "plan.rpc_timeout_seconds", "positive"),
        ({"max_steps": 0}, "plan.max_steps", "at least 1"),
        ({"schedule": "zigzag"}, "plan.schedule", "unknown schedule"),
    ],
)
def test_invalid_plans(changes: dict, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        dataclasses.replace(PLAN, **changes).check()
    assert info.value.field == field and fragment in info.value.message


def test_max_micro_batch_size_covers_training_and_validation_batches() -> None:
    assert max_micro_batch_size({"batch_size": 32, "val_batch_size": 256}, 4) == 64
    assert max_micro_batch_size({"batch_size": 100, "val_batch_size": 10}, 3) == 34
