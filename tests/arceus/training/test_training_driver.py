"""The driver's watch over an outstanding step of replicated stages (arceus/training/driver.py): a member the control
plane took off the job whose agent no longer answers gives the step up at once (a silent peer would otherwise hold it
until the RPC deadline); one taken off that still answers (a paused node's) finishes the step."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import replace

import pytest

from arceus.data.config import validate_dataset_config
from arceus.training.driver import WATCH_SECONDS, DriverError, Pipeline, _await_all
from arceus.training.plan import StageEndpoint, TrainPlan
from devtools.cluster import free_port
from devtools.pipeline import identity_for
from nodeagent.agent import Agent


def plan_with(agent: Agent, closed: str, placed: set[tuple[int, int]]) -> TrainPlan:
    """Two stages x two replicas: stage 1's replica 0 at `closed` (nothing listens), the others at `agent`."""
    def endpoint(index: int, replica: int) -> StageEndpoint:
        address, certificate = (
            (closed, identity_for(closed).certificate) if (index, replica) == (1, 0)
            else (agent.advertise_address, agent.identity.certificate)
        )
        return StageEndpoint(index=index, address=address, node_id=f"n{index}-{replica}", layer_start=index,
                             layer_end=index + 1, certificate=certificate, replica=replica)

    replicas = tuple(endpoint(i, r) for i in range(2) for r in range(2))
    return TrainPlan(
        job_id="watched", generation=1, credential="d" * 64, stages=(replicas[0], replicas[2]), replicas=replicas,
        dataset=validate_dataset_config({"name": "digits", "batch_size": 32}), epochs=1, learning_rate=0.1,
        micro_batches=2, seed=0, replica_placed=lambda: placed,
    )


def test_a_silent_member_taken_off_the_job_gives_the_step_up(agent: Agent) -> None:
    every = {(i, r) for i in range(2) for r in range(2)}
    placed = set(every)
    with Pipeline(plan_with(agent, f"127.0.0.1:{free_port()}", placed)) as pipeline:
        watch = pipeline._placed_watch(list(pipeline.replica_clients.values()))
        assert watch is not None and watch() is None  # every member placed
        placed.discard((1, 1))
        assert watch() is None  # taken off, but its agent answers: its step goes on
        placed.discard((1, 0))
        given_up = watch()
        assert isinstance(given_up, DriverError) and given_up.stage_index == 1 and "fell silent" in str(given_up)

        # an outstanding call is cancelled once the watch gives the step up, not at its deadline
        outstanding: Future[None] = Future()
        began = time.monotonic()
        with pytest.raises(DriverError, match="fell silent"):
            _await_all([(pipeline.replica_clients[(0, 0)], "RunStep", outstanding)], watch=watch)
        assert outstanding.cancelled() and time.monotonic() - began < WATCH_SECONDS + 5


def test_a_pipeline_without_the_control_planes_placements_watches_nothing(agent: Agent) -> None:
    plan = plan_with(agent, f"127.0.0.1:{free_port()}", set())
    plan = replace(plan, replica_placed=None)
    with Pipeline(plan) as pipeline:
        assert pipeline._placed_watch(list(pipeline.replica_clients.values())) is None
