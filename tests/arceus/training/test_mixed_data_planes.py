"""Agents that speak different data planes train together: a link takes a neighbour stream only where both its
agents declared it (arceus.contracts.data_plane), PushStream otherwise, and the losses are the same either way and
equal one process's. An agent that declares nothing (a version before neighbour streams) is given no `data_plane`
in its assignment, as the control plane gives it none."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from arceus.contracts.assignment import Assignment, max_micro_batch_size
from arceus.contracts.data_plane import SPOKEN
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import TrainPlan
from arceus.training.recording import RecordingSink
from devtools.pipeline import driver_token, pipeline_assignments, remember_identity, stage_endpoints
from nodeagent.agent import Agent
from nodeagent.stage import HostedStage
from tests.arceus.training.reference_jobs import reference_of

MODEL = {"type": "mlp", "layer_sizes": [64, 32, 16, 10]}
BOUNDARIES = [0, 1, 2, 3]
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES = 4
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}
SEED = 5
STEPS = 6
# Each job: the features each stage's agent declares; the links (0-1, 1-2) that take a neighbour stream.
JOBS = {
    "all-new": ([SPOKEN, SPOKEN, SPOKEN], (True, True)),
    "last-old": ([SPOKEN, SPOKEN, ()], (True, False)),
    "middle-old": ([SPOKEN, (), SPOKEN], (False, False)),
}


@pytest.fixture(scope="module")
def agents() -> Iterator[list[Agent]]:
    """Three agents, each hosting its stage of every job in JOBS."""
    started = [Agent(device=torch.device("cpu")) for _ in range(3)]
    for agent in started:
        agent.start()
        remember_identity(agent.advertise_address, agent.identity)
    per_agent: list[list[Assignment]] = [[], [], []]
    for job_id, (features, _) in JOBS.items():
        stages = pipeline_assignments(
            job_id=job_id, model_config=MODEL, boundaries=BOUNDARIES,
            addresses=[a.advertise_address for a in started], optimizer=OPTIMIZER, seed=SEED,
            micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
            features=features,
        )
        for i, stage in enumerate(stages):
            assert ("data_plane" in stage) == bool(features[i])  # an older agent is given none
            per_agent[i].append(Assignment.from_json(stage))
    for agent, assignments in zip(started, per_agent, strict=True):
        agent.apply_assignments(assignments)
    try:
        yield started
    finally:
        for agent in started:
            agent.stop(1)


def stage_of(agent: Agent, job_id: str) -> HostedStage:
    (stage,) = [s for s in agent.registry.stages() if s.assignment.job_id == job_id]
    return stage


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    return reference_of(MODEL, DATASET, OPTIMIZER, epochs=1, seed=SEED, max_steps=STEPS).losses


@pytest.mark.parametrize("job_id", list(JOBS))
def test_a_link_takes_a_neighbour_stream_only_where_both_agents_speak_it_and_the_losses_are_the_same(
    agents: list[Agent], reference_losses: list[float], job_id: str,
) -> None:
    plan = TrainPlan(
        job_id=job_id, generation=1, credential=driver_token(job_id, 1),
        stages=stage_endpoints([a.advertise_address for a in agents], BOUNDARIES), dataset=DATASET, epochs=1,
        learning_rate=OPTIMIZER["lr"], micro_batches=MICRO_BATCHES, seed=SEED, rpc_timeout_seconds=30.0,
        max_steps=STEPS,
    )
    recorder = RecordingSink()
    result = train(plan, recorder)
    assert result.steps == STEPS and not result.stopped
    for step, (got, want) in enumerate(zip([p.loss for p in recorder.steps], reference_losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: {got!r} != one process's {want!r}"

    _, streamed = JOBS[job_id]
    for lower, link_streamed in enumerate(streamed):
        sender, receiver = stage_of(agents[lower], job_id), stage_of(agents[lower + 1], job_id)
        # Both ends agree, from their assignments alone, and the stream was opened only on a streamed link.
        assert sender.neighbours.next_streamed == receiver.neighbours.prev_streamed == link_streamed
        assert ("next" in sender.neighbours._streams) == ("prev" in receiver.neighbours._streams) == link_streamed
