"""A train step the driver sends before the step it follows answered (RunStepRequest.after_step) runs on each stage
once that step finished there, and not at all where that step failed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from arceus.data.config import validate_dataset_config
from arceus.v1 import stage_pb2, stage_pb2_grpc
from nodeagent.agent import Agent
from tests.nodeagent.two_stage_mlp import two_stage_stub

JOB = "chained"
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES, BATCH = 2, 32


@pytest.fixture
def stub(agent: Agent) -> Iterator[stage_pb2_grpc.StageServiceStub]:
    """The driver's stub for a two-stage MLP whose stages this agent both hosts."""
    with two_stage_stub(agent, JOB, micro_batches=MICRO_BATCHES, batch=BATCH) as stub:
        yield stub


def run_steps(
    stub: stage_pb2_grpc.StageServiceStub, step: int, *, after_step: int = 0, first_index: int = 0
) -> list[grpc.Future]:
    """RunStep `step` sent to both stages (each reading its samples: `first_index` and the batch after it)."""
    data = stage_pb2.StepData(dataset_json=json.dumps(DATASET), indices=range(first_index, first_index + BATCH))
    return [
        stub.RunStep.future(
            stage_pb2.RunStepRequest(
                target=stage_pb2.StageRef(job_id=JOB, stage_index=index, generation=1), step=step,
                mode=stage_pb2.TRAIN, num_micro_batches=MICRO_BATCHES, schedule="gpipe", batch_size=BATCH,
                data=data, after_step=after_step,
            ),
            timeout=30,
        )
        for index in (0, 1)
    ]


def test_a_step_sent_before_the_one_it_follows_runs_after_it(stub: stage_pb2_grpc.StageServiceStub) -> None:
    second = run_steps(stub, 2, after_step=1)  # reaches the stages first: it waits for step 1
    first = run_steps(stub, 1)
    replies = [f.result() for f in first + second]
    assert [r.counters.samples for r in replies] == [BATCH, BATCH, 2 * BATCH, 2 * BATCH]
    assert [sum(r.sample_counts) for r in (replies[1], replies[3])] == [BATCH, BATCH]


def test_a_step_chained_after_a_failed_one_does_not_run(stub: stage_pb2_grpc.StageServiceStub) -> None:
    second = run_steps(stub, 2, after_step=1)
    first = run_steps(stub, 1, first_index=10**6)  # samples the split does not have: step 1 fails on both stages
    for future in first:
        assert future.exception().code() == grpc.StatusCode.INVALID_ARGUMENT
    for future in second:
        assert future.exception().code() == grpc.StatusCode.ABORTED
        assert "step 1 failed" in future.exception().details()
    # The stages ran nothing: the next step trains from the start.
    replies = [f.result() for f in run_steps(stub, 3)]
    assert [r.counters.samples for r in replies] == [BATCH, BATCH]


def test_after_step_must_name_an_earlier_step(stub: stage_pb2_grpc.StageServiceStub) -> None:
    [future, _] = run_steps(stub, 2, after_step=2)
    assert future.exception().code() == grpc.StatusCode.INVALID_ARGUMENT
