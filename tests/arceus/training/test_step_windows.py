"""Windows of train steps (RunSteps, arceus.contracts.step_window): each stage runs a window's steps back to back and
answers each as it finishes; the driver's outcome of every step equals the one a RunStep of its own gives, a step that
fails in a window fails as it would alone (the steps before it stand), and a training run's windows end at its
checkpoints and epochs, its losses still those of one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from arceus.contracts.assignment import Assignment, max_micro_batch_size
from arceus.data.batches import epoch_batches
from arceus.data.config import validate_dataset_config
from arceus.data.streaming import dataset_samples
from arceus.training.driver import Batch, DriverError, Pipeline, StepOutcome, train
from arceus.training.plan import StageStateFile, TrainPlan
from arceus.training.recording import RecordingSink
from devtools.pipeline import driver_token, pipeline_assignments, remember_identity, stage_endpoints
from nodeagent.agent import Agent
from nodeagent.stage import HostedStage
from tests.arceus.training.reference_jobs import reference_of

MODEL, OPTIMIZER = {"type": "mlp", "layer_sizes": [64, 32, 16, 10]}, {"name": "sgd", "lr": 0.1, "momentum": 0.9}
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
BATCH, MICRO_BATCHES, BOUNDARIES = 32, 2, [0, 1, 2, 3]


def _host(agent: Agent, *jobs: str) -> list[str]:
    remember_identity(agent.advertise_address, agent.identity)
    addresses = [agent.advertise_address] * (len(BOUNDARIES) - 1)
    agent.apply_assignments([Assignment.from_json(a) for job in jobs for a in pipeline_assignments(
        job_id=job, model_config=MODEL, boundaries=BOUNDARIES, addresses=addresses, optimizer=OPTIMIZER, seed=0,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
    )])
    return addresses


def _plan(job: str, addresses: list[str], *, epochs: int = 1, max_steps: int | None = None,
          checkpoint_interval: int = 0) -> TrainPlan:
    return TrainPlan(
        job_id=job, generation=1, credential=driver_token(job), stages=stage_endpoints(addresses, BOUNDARIES),
        dataset=DATASET, epochs=epochs, learning_rate=OPTIMIZER["lr"], micro_batches=MICRO_BATCHES, seed=0,
        rpc_timeout_seconds=30.0, max_steps=max_steps, checkpoint_interval=checkpoint_interval,
    )


def _same(a: StepOutcome, b: StepOutcome) -> None:
    assert math.isclose(a.loss_sum, b.loss_sum, rel_tol=1e-6) and a.correct == b.correct
    assert (a.samples, a.labels) == (b.samples, b.labels)
    assert [(s.samples, s.micro_batches) for s in a.stages] == [(s.samples, s.micro_batches) for s in b.stages]


def test_a_windows_steps_equal_steps_sent_one_by_one_and_a_failed_step_leaves_those_before(
    agent: Agent, tmp_path: Path
) -> None:
    addresses = _host(agent, "windowed", "one-by-one")
    with dataset_samples(DATASET, None) as (train_set, _):
        order = epoch_batches(len(train_set), BATCH, 0, 1)
        # A sample the stages cannot read: stage 0 (its inputs) and the last stage (its labels) fail the step.
        beyond = torch.full((BATCH,), len(train_set) + 5)
        with Pipeline(_plan("windowed", addresses)) as windowed, Pipeline(_plan("one-by-one", addresses)) as single:
            assert windowed.windows
            alone = [single.step(Batch(train_set, order[k]), train=True, train_step=k + 1) for k in range(4)]
            got = list(windowed.window([Batch(train_set, order[k]) for k in range(3)], first_train_step=1))
            assert len(got) == 3
            for a, b in zip(got, alone, strict=False):
                _same(a, b)

            taken: list[StepOutcome] = []
            batches = [Batch(train_set, order[3]), Batch(train_set, beyond), Batch(train_set, order[4])]
            with pytest.raises(DriverError) as failed:
                taken.extend(windowed.window(batches, first_train_step=4))
            # Whichever stage's failure reaches the driver first: stage 0 or the last refusing the samples, or stage 1
            # losing its neighbour stream to stage 0 (as with RunSteps of their own).
            assert (failed.value.stage_index, failed.value.code) in {
                (0, "INVALID_ARGUMENT"), (2, "INVALID_ARGUMENT"), (1, "UNAVAILABLE"), (1, "FAILED_PRECONDITION"),
            }
            assert "step 2 of a window of 3" in str(failed.value)
            assert len(taken) == 1
            _same(taken[0], alone[3])
            # Once the window's other steps stopped, the stages hold step 4's state, as the one-by-one pipeline's do.
            (tmp_path / "w").mkdir(), (tmp_path / "s").mkdir()
            held = [s.sha256 for s in windowed.states(tmp_path / "w")]
            assert held == [s.sha256 for s in single.states(tmp_path / "s")]
            after = windowed.step(Batch(train_set, order[4]), train=True, train_step=5)
            _same(after, single.step(Batch(train_set, order[4]), train=True, train_step=5))


class Checkpoints(RecordingSink):
    """Notes what stage 0 had computed at each checkpoint."""

    def __init__(self, stage_0: HostedStage) -> None:
        super().__init__()
        self.stage_0 = stage_0
        self.computed_at_checkpoint: dict[int, int] = {}

    def on_checkpoint(self, step: int, epoch: int, stages: list[StageStateFile]) -> None:
        super().on_checkpoint(step, epoch, stages)
        self.computed_at_checkpoint[step] = self.stage_0.runtime.counters.samples


def test_windows_end_at_checkpoints_and_epochs_and_train_as_one_process(agent: Agent) -> None:
    addresses = _host(agent, "windows")
    [stage_0] = [s for s in agent.registry.stages() if s.assignment.stage_index == 0]
    sink = Checkpoints(stage_0)
    steps = 45 + 6  # digits' training split is 1438 samples: 45 batches, the last of 30

    result = train(_plan("windows", addresses, epochs=2, max_steps=steps, checkpoint_interval=20), sink)
    assert result.steps == steps and [p.step for p in sink.steps] == list(range(1, steps + 1))
    # At a checkpoint no step of a window is under way: stage 0 computed exactly the steps up to it.
    assert {step: sink.computed_at_checkpoint[step] for step in (20, 40)} == {20: 20 * BATCH, 40: 40 * BATCH}
    expected = reference_of(MODEL, DATASET, OPTIMIZER, epochs=2, seed=0, max_steps=steps)
    for step, (got, want) in enumerate(zip([p.loss for p in sink.steps], expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: windowed loss {got!r} != one process's {want!r}"
