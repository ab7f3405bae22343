"""A train step its agents refuse as beyond the job's step grant (nodeagent/step_grants.py) stops the driver where
its stages are, as a stop and not a fault: nothing raised, blamed or rewound, every stage at the last granted step."""

from __future__ import annotations

from arceus.contracts.assignment import Assignment, max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import ReplicaFence, TrainPlan
from arceus.training.recording import RecordingSink
from devtools.pipeline import (
    driver_token,
    pipeline_assignments,
    remember_identity,
    replica_endpoints,
    stage_endpoints,
)
from nodeagent.agent import Agent
from tests.arceus.training.replicated_agents import agents_hosting

JOB = "granted-driver"
MODEL, OPTIMIZER = {"type": "mlp", "layer_sizes": [64, 32, 10]}, {"name": "sgd", "lr": 0.1}
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
BATCH, MICRO_BATCHES, GRANT = 32, 2, 3


def test_the_driver_stops_at_the_grant_its_agents_hold(agent: Agent) -> None:
    remember_identity(agent.advertise_address, agent.identity)
    addresses, boundaries = [agent.advertise_address] * 2, [0, 1, 2]
    agent.apply_assignments([Assignment.from_json(a) for a in pipeline_assignments(
        job_id=JOB, model_config=MODEL, boundaries=boundaries, addresses=addresses, optimizer=OPTIMIZER, seed=0,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
    )])
    agent.take_step_grants({JOB: GRANT})  # as a cancel left it: no reply extends it
    sink = RecordingSink()
    plan = TrainPlan(
        job_id=JOB, generation=1, credential=driver_token(JOB), stages=stage_endpoints(addresses, boundaries),
        dataset=DATASET, epochs=1, learning_rate=OPTIMIZER["lr"], micro_batches=MICRO_BATCHES, seed=0, max_steps=10,
        rpc_timeout_seconds=5.0,  # a refused step answers by its call's deadline
    )
    result = train(plan, sink)
    assert result.stopped and result.steps == GRANT and [p.step for p in sink.steps] == [1, 2, 3]
    assert f"train step {GRANT + 1} of job {JOB}" in result.stop_reason
    assert f"the step grant is {GRANT}" in result.stop_reason
    # The step sent ahead of the refused one ran nowhere: every stage trained exactly the granted steps.
    assert sorted(s.runtime.counters.samples for s in agent.registry.stages()) == [GRANT * BATCH] * 2
    assert sink.epochs == []  # a stop: no validation


def test_replicas_refusing_a_step_stop_the_driver_without_blaming_or_fencing_any() -> None:
    """Replicated stages: every replica refuses the step after the grant; the driver neither drops nor fences one."""
    placement = [[0, 1], [2, 3], [4, 5]]
    fenced: list[ReplicaFence] = []
    with agents_hosting(
        placement, job_id=JOB, model_config={"type": "mlp", "layer_sizes": [64, 32, 16, 10]},
        boundaries=[0, 1, 2, 3], optimizer=OPTIMIZER, seed=0, micro_batches=4,
        max_micro_batch_size=max_micro_batch_size(DATASET, 4),
    ) as started:
        for agent in started:
            agent.take_step_grants({JOB: GRANT})
        stages, replicas = replica_endpoints([[started[a].advertise_address for a in hosts] for hosts in placement],
                                             [0, 1, 2, 3])
        plan = TrainPlan(
            job_id=JOB, generation=1, credential=driver_token(JOB, 1), stages=stages, replicas=replicas,
            dataset=DATASET, epochs=1, learning_rate=OPTIMIZER["lr"], micro_batches=4, seed=0, max_steps=10,
            rpc_timeout_seconds=5.0, replica_fenced=fenced.append,
        )
        result = train(plan, RecordingSink())
        assert result.stopped and result.steps == GRANT and f"the step grant is {GRANT}" in result.stop_reason
        assert fenced == []
        # Every replica trained its share of the granted steps and nothing of the refused one.
        for hosts in placement:
            assert sum(a.registry.stages()[0].runtime.counters.samples for a in (started[h] for h in hosts)) == (
                GRANT * BATCH)
