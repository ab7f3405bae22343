"""A RunSteps window as its steps' RunStep requests: each the first's with its own call id, training step, samples and
learning rate, chained after the step before; windows a stage cannot run are refused with what is wrong."""

from __future__ import annotations

import grpc
import pytest

from arceus.contracts.step_window import MAX_WINDOW_STEPS
from arceus.v1 import stage_pb2
from nodeagent.rpc import RpcFailure
from nodeagent.step_window import window_requests

REF = stage_pb2.StageRef(job_id="j", stage_index=0, generation=1)


def _window(count: int = 3, **first: object) -> stage_pb2.RunStepsRequest:
    head = stage_pb2.RunStepRequest(
        target=REF, step=7, mode=stage_pb2.TRAIN, num_micro_batches=2, schedule="gpipe", batch_size=4,
        learning_rate=0.1, train_step=3, data=stage_pb2.StepData(dataset_json="{}", indices=[0, 1, 2, 3]),
    )
    for name, value in first.items():
        setattr(head, name, value)
    following = [
        stage_pb2.WindowStep(step=7 + k, train_step=3 + k, learning_rate=0.1 / (k + 1),
                             data=stage_pb2.StepData(dataset_json="{}", indices=[4 * k + i for i in range(4)]))
        for k in range(1, count)
    ]
    return stage_pb2.RunStepsRequest(first=head, next=following, step_seconds=30.0)


def test_each_step_is_the_first_with_its_own_id_samples_and_rate_chained_after_the_one_before() -> None:
    steps = window_requests(_window(), staleness=0)
    assert [(s.step, s.train_step, s.after_step) for s in steps] == [(7, 3, 0), (8, 4, 7), (9, 5, 8)]
    assert [list(s.data.indices) for s in steps] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [s.learning_rate for s in steps] == [0.1, 0.05, pytest.approx(0.1 / 3)]
    assert all(s.target == REF and s.batch_size == 4 and s.num_micro_batches == 2 for s in steps)


def test_a_middle_stage_steps_carry_no_samples() -> None:
    window = _window()
    window.first.ClearField("data")
    for step in window.next:
        step.ClearField("data")
    assert not any(s.HasField("data") for s in window_requests(window, staleness=0))


@pytest.mark.parametrize(("window", "staleness", "code", "names"), [
    (_window(mode=stage_pb2.EVAL), 0, grpc.StatusCode.INVALID_ARGUMENT, "train steps"),
    (_window(retain_for_audit=True), 0, grpc.StatusCode.INVALID_ARGUMENT, "not audited"),
    (_window(after_step=7), 0, grpc.StatusCode.INVALID_ARGUMENT, "not a step before step 7"),
    (_window(MAX_WINDOW_STEPS + 1), 0, grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_WINDOW_STEPS}"),
    (_window(), 1, grpc.StatusCode.FAILED_PRECONDITION, "staleness 1"),
])
def test_windows_a_stage_cannot_run_are_refused(
    window: stage_pb2.RunStepsRequest, staleness: int, code: grpc.StatusCode, names: str
) -> None:
    with pytest.raises(RpcFailure, match=names) as refused:
        window_requests(window, staleness=staleness)
    assert refused.value.code == code


def test_call_ids_must_ascend_and_steps_have_a_time() -> None:
    window = _window()
    window.next[1].step = 8
    with pytest.raises(RpcFailure, match="ascend"):
        window_requests(window, staleness=0)
    window = _window()
    window.step_seconds = 0
    with pytest.raises(RpcFailure, match="step_seconds"):
        window_requests(window, staleness=0)


def test_a_window_may_be_chained_after_the_last_step_of_the_one_before() -> None:
    steps = window_requests(_window(after_step=6), staleness=0)
    assert [(s.step, s.after_step) for s in steps] == [(7, 6), (8, 7), (9, 8)]


def test_a_window_of_one_step_runs_with_staleness_1() -> None:
    assert [s.step for s in window_requests(_window(1), staleness=1)] == [7]
