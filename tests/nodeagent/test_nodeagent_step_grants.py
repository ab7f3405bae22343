"""An agent trains only up to the step the control plane granted its job (nodeagent/step_grants.py): a RunStep of a
train step beyond the grant waits a bounded time for a heartbeat reply to extend it, then is refused with
FAILED_PRECONDITION naming the step and the grant; a granted step never goes back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from arceus.contracts.step_grant import is_not_granted
from arceus.data.config import validate_dataset_config
from arceus.v1 import stage_pb2, stage_pb2_grpc
from nodeagent.agent import Agent
from nodeagent.control_plane import ControlPlaneClient, HeartbeatLoop
from nodeagent.step_grants import StepGrants, StepNotGranted
from tests.nodeagent.test_nodeagent_control_plane import wait_for
from tests.nodeagent.two_stage_mlp import two_stage_stub

JOB = "granted"
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES, BATCH = 2, 32


@pytest.fixture
def stub(agent: Agent) -> Iterator[stage_pb2_grpc.StageServiceStub]:
    """The driver's stub for JOB's two stages, which this agent both hosts."""
    with two_stage_stub(agent, JOB, micro_batches=MICRO_BATCHES, batch=BATCH) as stub:
        yield stub


def train(stub: stage_pb2_grpc.StageServiceStub, train_step: int, timeout: float = 30) -> list[grpc.Future]:
    """Train step `train_step` (its RunStep call id the same) sent to both stages, each reading its samples."""
    data = stage_pb2.StepData(dataset_json=json.dumps(DATASET), indices=range(BATCH * (train_step - 1),
                                                                              BATCH * train_step))
    return [
        stub.RunStep.future(
            stage_pb2.RunStepRequest(
                target=stage_pb2.StageRef(job_id=JOB, stage_index=index, generation=1), step=train_step,
                mode=stage_pb2.TRAIN, num_micro_batches=MICRO_BATCHES, schedule="gpipe", batch_size=BATCH,
                data=data, train_step=train_step,
            ),
            timeout=timeout,
        )
        for index in (0, 1)
    ]


def test_an_agent_runs_its_grant_and_refuses_the_step_after_it(agent: Agent, stub) -> None:  # noqa: ANN001
    asked: list[float] = []
    agent.ask_heartbeats_with(lambda: asked.append(time.monotonic()))
    agent.take_step_grants({JOB: 1})
    assert [f.result().counters.samples for f in train(stub, 1)] == [BATCH, BATCH]
    started = time.monotonic()
    for future in train(stub, 2, timeout=3):  # refused by the call's deadline
        error = future.exception()
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and is_not_granted(error.code().name,
                                                                                     error.details())
        assert f"train step 2 of job {JOB}" in error.details() and "the step grant is 1" in error.details()
    assert 1.5 < time.monotonic() - started < 10  # it waited for a reply to extend the grant, and asked for one
    assert len(asked) == 2
    agent.take_step_grants({JOB: 0})  # a reply overtaken by a newer one: ignored
    assert agent.registry.grants.granted(JOB) == 1
    # A grant extended while the step waits lets it run: nothing of the refused attempt was trained.
    agent.ask_heartbeats_with(lambda: threading.Timer(0.1, agent.take_step_grants, ({JOB: 2},)).start())
    assert [f.result().counters.samples for f in train(stub, 2)] == [2 * BATCH, 2 * BATCH]


def test_a_train_step_must_name_its_step_where_steps_are_granted(agent: Agent, stub) -> None:  # noqa: ANN001
    agent.take_step_grants({JOB: 5})
    unnamed = stage_pb2.RunStepRequest(  # train_step 0: a step that would slip past any grant
        target=stage_pb2.StageRef(job_id=JOB, stage_index=0, generation=1), step=1, mode=stage_pb2.TRAIN,
        num_micro_batches=MICRO_BATCHES, schedule="gpipe", batch_size=BATCH)
    with pytest.raises(grpc.RpcError) as refused:
        stub.RunStep(unnamed, timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "names no training step" in refused.value.details()


def test_without_a_control_plane_nothing_is_bounded() -> None:
    grants = StepGrants()
    grants.require("any", 10**6, deadline=time.monotonic() + 1, abort=threading.Event())  # static assignments
    grants.update({})  # a control plane's first reply: from now on every job is bounded
    with pytest.raises(StepNotGranted, match="no step granted yet"):
        grants.require("any", 1, deadline=time.monotonic() + 0.1, abort=threading.Event())


def test_the_heartbeat_loop_hands_the_replies_grants_to_the_agent(control_plane, agent: Agent) -> None:  # noqa: ANN001
    control_plane.interval = 0.05
    control_plane.step_grants = {JOB: 7}
    loop = HeartbeatLoop(ControlPlaneClient(control_plane.url, control_plane.token), agent, interval=0.05,
                         on_fatal=lambda message: None)
    loop.start()
    try:
        wait_for(lambda: agent.registry.grants.granted(JOB) == 7)
        control_plane.step_grants = {JOB: 9}
        wait_for(lambda: agent.registry.grants.granted(JOB) == 9)
        control_plane.step_grants = {JOB: 3}  # reordered: a lower grant never takes one back
        seen = len(control_plane.heartbeats())
        wait_for(lambda: len(control_plane.heartbeats()) > seen + 2)
        assert agent.registry.grants.granted(JOB) == 9
        control_plane.step_grants = {}  # the job was cancelled, or ended: no step of it is granted any more
        wait_for(lambda: agent.registry.grants.granted(JOB) is None)
    finally:
        loop.stop()
