"""The driver sends each train step with the one before (RunStepRequest.after_step), so the stages go on to it while
the driver is still recording the step before; never across a checkpoint (its state is of exactly its step). Chained,
training still equals one process."""

from __future__ import annotations

import math
import time

from arceus.contracts.assignment import Assignment, max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import StageStateFile, StepProgress, TrainPlan
from arceus.training.recording import RecordingSink
from devtools.pipeline import driver_token, pipeline_assignments, remember_identity, stage_endpoints
from nodeagent.agent import Agent
from nodeagent.stage import HostedStage
from tests.arceus.training.reference_jobs import reference_of

JOB = "chained-driver"
MODEL, OPTIMIZER = {"type": "mlp", "layer_sizes": [64, 32, 10]}, {"name": "sgd", "lr": 0.1, "momentum": 0.9}
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
BATCH, MICRO_BATCHES, STEPS, CHECKPOINT_INTERVAL = 32, 2, 6, 3


class SlowRecording(RecordingSink):
    """Records a step only once stage 0 has computed the next step's forwards, or after 10 s (as a driver slow to
    write its records would); notes whether stage 0 had, and what stage 0 had computed at each checkpoint."""

    def __init__(self, stage_0: HostedStage) -> None:
        super().__init__()
        self.stage_0 = stage_0
        self.went_on: dict[int, bool] = {}
        self.computed_at_checkpoint: dict[int, int] = {}

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        if p.step % CHECKPOINT_INTERVAL and p.step < STEPS:
            ends = time.monotonic() + 10
            while self.forward_samples() < (p.step + 1) * BATCH and time.monotonic() < ends:
                time.sleep(0.01)
            self.went_on[p.step] = self.forward_samples() >= (p.step + 1) * BATCH

    def on_checkpoint(self, step: int, epoch: int, stages: list[StageStateFile]) -> None:
        super().on_checkpoint(step, epoch, stages)
        self.computed_at_checkpoint[step] = self.forward_samples()

    def forward_samples(self) -> int:
        return self.stage_0.runtime.counters.samples


def test_the_stages_go_on_to_the_next_step_while_the_driver_records_one(agent: Agent) -> None:
    remember_identity(agent.advertise_address, agent.identity)
    addresses, boundaries = [agent.advertise_address] * 2, [0, 1, 2]
    agent.apply_assignments([Assignment.from_json(a) for a in pipeline_assignments(
        job_id=JOB, model_config=MODEL, boundaries=boundaries, addresses=addresses, optimizer=OPTIMIZER, seed=0,
        micro_batches=MICRO_BATCHES,
        max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
    )])
    [stage_0] = [s for s in agent.registry.stages() if s.assignment.stage_index == 0]
    sink = SlowRecording(stage_0)
    plan = TrainPlan(
        job_id=JOB, generation=1, credential=driver_token(JOB), stages=stage_endpoints(addresses, boundaries),
        dataset=DATASET, epochs=1, learning_rate=OPTIMIZER["lr"], micro_batches=MICRO_BATCHES, seed=0, max_steps=STEPS,
        checkpoint_interval=CHECKPOINT_INTERVAL, rpc_timeout_seconds=30.0,
    )
    result = train(plan, sink)
    assert result.steps == STEPS and [p.step for p in sink.steps] == list(range(1, STEPS + 1))
    assert sink.went_on == {1: True, 2: True, 4: True, 5: True}
    # At a checkpoint no step is under way: stage 0 computed exactly the steps up to it.
    assert sink.computed_at_checkpoint[3] == 3 * BATCH
    # Every step's samples counted once, whatever ran ahead.
    assert [s.samples for s in sink.steps[-1].stages] == [STEPS * BATCH] * 2
    expected = reference_of(MODEL, DATASET, OPTIMIZER, epochs=1, seed=0, max_steps=STEPS)
    for step, (got, want) in enumerate(zip([p.loss for p in sink.steps], expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: chained loss {got!r} != one process's {want!r}"
