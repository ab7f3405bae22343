"""A replica's step is freed as soon as the next one commits it: nothing of a finished step (its StepRun, the HeldStep
with its partial gradient, a whole stage's worth) waits for Python's cycle collector. Held in a reference cycle, each
step's partial lived on until a full collection, which an agent moving few Python objects seldom runs: an agent of a
50M-parameter stage grew by about one gradient (193 MiB) a step (docs/BENCHMARKS.md, "Where an agent's peak comes
from")."""

from __future__ import annotations

import gc
import weakref

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import StepProgress, TrainPlan
from arceus.training.recording import RecordingSink
from devtools.pipeline import driver_token, replica_endpoints
from nodeagent.agent import Agent
from nodeagent.repair import HeldStep
from tests.arceus.training.replicated_agents import agents_hosting

MLP = {"type": "mlp", "layer_sizes": [64, 32, 10]}
BOUNDARIES = [0, 1, 2]
DIGITS = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES, STEPS = 4, 4


class HeldSteps(RecordingSink):
    """A weak reference to every replica's held step, after each step."""

    def __init__(self, agents: list[Agent]) -> None:
        super().__init__()
        self.agents, self.held = agents, []

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        for agent in self.agents:
            (stage,) = agent.registry.stages()
            assert isinstance(stage.held_step, HeldStep)
            self.held.append((p.step, weakref.ref(stage.held_step)))


def test_a_replicas_committed_steps_are_freed_without_the_cycle_collector() -> None:
    placement = [[0, 1], [2, 3]]
    with agents_hosting(
        placement, job_id="freed", model_config=MLP, boundaries=BOUNDARIES, optimizer={"name": "sgd", "lr": 0.1},
        seed=0, micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DIGITS, MICRO_BATCHES),
    ) as agents:
        stages, replicas = replica_endpoints([[a.advertise_address for a in (agents[0], agents[1])],
                                              [a.advertise_address for a in (agents[2], agents[3])]], BOUNDARIES)
        plan = TrainPlan(job_id="freed", generation=1, credential=driver_token("freed", 1), stages=stages,
                         replicas=replicas, dataset=DIGITS, epochs=1, learning_rate=0.1, micro_batches=MICRO_BATCHES,
                         seed=0, rpc_timeout_seconds=30.0, max_steps=STEPS)
        sink = HeldSteps(agents)
        gc.collect()
        gc.disable()
        try:
            train(plan, sink)
            kept = [step for step, held in sink.held if held() is not None]
        finally:
            gc.enable()
    assert len(sink.held) == STEPS * len(agents)
    # A replica holds its last step until a next step (or the end's checkpoint read) commits it; every earlier is gone.
    assert all(step == STEPS for step in kept), f"held steps alive after their commit: steps {kept}"
