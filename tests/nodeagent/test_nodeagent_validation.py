"""A RunStep is checked against the stage's assignment before any work: here, that its schedule holds no more
micro-batches at once than the one the stage's memory was checked for."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from arceus.model.layout import TensorLayout
from arceus.v1 import stage_pb2
from nodeagent.rpc import RpcFailure
from nodeagent.stage_io import StageIO
from nodeagent.validation import check_run_step

HIDDEN = TensorLayout("float32", (8,))
FIRST_OF_THREE = StageIO(input_layout=HIDDEN, output_layout=HIDDEN, label_layout=HIDDEN, max_micro_batch_size=2,
                         micro_batches=2, schedule="1f1b", stage_index=0, num_stages=3, is_first=True, is_last=False)


def run_step(schedule: str) -> stage_pb2.RunStepRequest:
    return stage_pb2.RunStepRequest(step=1, mode=stage_pb2.TRAIN, num_micro_batches=2, schedule=schedule, batch_size=4)


def test_a_schedule_holding_no_more_than_the_assignments_is_taken() -> None:
    assert check_run_step(FIRST_OF_THREE, run_step("gpipe")) == "gpipe"  # stage 0 of 3: both hold 2 of 2
    gpipe_assignment = dataclasses.replace(FIRST_OF_THREE, schedule="gpipe", stage_index=2, is_first=False)
    assert check_run_step(gpipe_assignment, run_step("1f1b")) == "1f1b"  # 1F1B holds fewer than GPipe


def test_a_schedule_holding_more_than_the_assignments_is_invalid() -> None:
    last = dataclasses.replace(FIRST_OF_THREE, stage_index=2, is_first=False, is_last=True)  # 1F1B holds 1 here
    with pytest.raises(RpcFailure) as info:
        check_run_step(last, run_step("gpipe"))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message == (
        "schedule 'gpipe' holds 2 micro-batches at once on this stage, more than the 1 of its assignment's "
        "'1f1b', which its memory was checked for"
    )


def test_a_negative_training_step_is_invalid() -> None:
    """The training step seeds dropout's masks (arceus.model.seeding): 0 (unset) or a step of the job."""
    request = run_step("1f1b")
    request.train_step = 7
    assert check_run_step(FIRST_OF_THREE, request) == "1f1b"
    request.train_step = -1
    with pytest.raises(RpcFailure) as info:
        check_run_step(FIRST_OF_THREE, request)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message == "train_step must be >= 0, got -1"
