"""A RunSteps window (arceus.contracts.step_window) as the RunStep requests of its steps, checked: each step after the
first is the first's request with its own call id, training step, samples and learning rate, chained after the step
before it (`after_step`); the first may be chained after the last step of the window before (the driver sends the
next window before this one ended)."""

from __future__ import annotations

import grpc

from arceus.contracts.step_window import MAX_WINDOW_STEPS
from arceus.v1 import stage_pb2
from nodeagent.rpc import RpcFailure


def window_requests(request: stage_pb2.RunStepsRequest, *, staleness: int) -> list[stage_pb2.RunStepRequest]:
    """The window's steps in order; INVALID_ARGUMENT naming what is wrong with a window a stage cannot run, and
    FAILED_PRECONDITION for a stage of a job with staleness 1 (its steps overlap: one RunStep each)."""
    first = request.first

    def refuse(why: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> RpcFailure:
        return RpcFailure(code, f"RunSteps: {why}")

    if not request.step_seconds > 0:
        raise refuse(f"step_seconds must be positive, got {request.step_seconds}")
    if len(request.next) >= MAX_WINDOW_STEPS:
        raise refuse(f"a window holds at most {MAX_WINDOW_STEPS} steps, got {1 + len(request.next)}")
    if first.mode != stage_pb2.TRAIN or first.HasField("replicas") or first.retain_for_audit:
        raise refuse("a window is of train steps of stages that are not replicated and not audited: send such steps "
                     "one RunStep each")
    if first.after_step and not 0 < first.after_step < first.step:
        raise refuse(f"after_step {first.after_step} is not a step before step {first.step}")
    if request.next and staleness:
        raise refuse("a job with staleness 1 overlaps its steps: send them one RunStep each, chained (after_step)",
                     grpc.StatusCode.FAILED_PRECONDITION)
    steps = [first]
    for window_step in request.next:
        before = steps[-1]
        if window_step.step <= before.step:
            raise refuse(f"step {window_step.step} follows step {before.step}: a window's call ids ascend")
        step = stage_pb2.RunStepRequest()
        step.CopyFrom(first)
        step.step, step.train_step, step.learning_rate = window_step.step, window_step.train_step, \
            window_step.learning_rate
        step.after_step = before.step
        if window_step.HasField("data"):
            step.data.CopyFrom(window_step.data)
        else:
            step.ClearField("data")
        steps.append(step)
    return steps
