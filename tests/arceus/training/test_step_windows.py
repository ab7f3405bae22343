"""Windows of train steps (RunSteps, arceus.contracts.step_window): each stage runs a window's steps back to back and
answers each as it finishes; the driver's outcome of every step equals the one a RunStep of its own gives, a step that
fails in a window fails as it would alone (the steps before it stand), and a training run's windows end at its
checkpoints and epochs, its losses still those of one process."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from arceus.contracts.assignment import Assignment, max_micro_batch_size
from arceus.contracts.step_window import MAX_WINDOW_STEPS
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


def _computed(stage: HostedStage, samples: int, seconds: float = 30.0) -> bool:
    """Whether `stage` computed `samples` samples within `seconds`."""
    deadline = time.monotonic() + seconds
    while stage.runtime.counters.samples < samples and time.monotonic() < deadline:
        time.sleep(0.01)
    return stage.runtime.counters.samples == samples


def test_a_window_sent_before_the_one_before_ended_runs_chained_after_it_with_no_barrier(agent: Agent) -> None:
    addresses = _host(agent, "chained", "one-by-one")
    stages = [s for s in agent.registry.stages() if s.assignment.job_id == "chained"]
    with dataset_samples(DATASET, None) as (train_set, _):
        order = epoch_batches(len(train_set), BATCH, 0, 1)
        with Pipeline(_plan("chained", addresses)) as chained, Pipeline(_plan("one-by-one", addresses)) as single:
            alone = [single.step(Batch(train_set, order[k]), train=True, train_step=k + 1) for k in range(5)]
            first = chained.window([Batch(train_set, order[k]) for k in range(3)], first_train_step=1)
            second = chained.window([Batch(train_set, order[k]) for k in range(3, 5)], first_train_step=4)
            # Before the driver took a single reply, every stage ran both windows: the second went on from the first
            # with no round trip to the driver between them.
            assert all(_computed(s, 5 * BATCH) for s in stages)
            got = [*first, *second]
            assert len(got) == 5
            for a, b in zip(got, alone, strict=True):
                _same(a, b)


def test_a_failure_in_a_window_cancels_the_one_chained_after_it_and_loses_no_step(
    agent: Agent, tmp_path: Path
) -> None:
    addresses = _host(agent, "failing", "one-by-one")
    with dataset_samples(DATASET, None) as (train_set, _):
        order = epoch_batches(len(train_set), BATCH, 0, 1)
        beyond = torch.full((BATCH,), len(train_set) + 5)  # a sample no stage can read: the step fails
        with Pipeline(_plan("failing", addresses)) as chained, Pipeline(_plan("one-by-one", addresses)) as single:
            alone = [single.step(Batch(train_set, order[0]), train=True, train_step=1)]
            first = chained.window([Batch(train_set, order[0]), Batch(train_set, beyond)], first_train_step=1)
            second = chained.window([Batch(train_set, order[1]), Batch(train_set, order[2])], first_train_step=2)
            taken: list[StepOutcome] = []
            with pytest.raises(DriverError, match="step 2 of a window of 2"):
                taken.extend(first)
            assert len(taken) == 1
            _same(taken[0], alone[0])
            with pytest.raises(ValueError, match="taken after"):
                next(second)  # cancelled with the failure
            # No stage ran a step of the chained window: once the failed step stopped, each holds step 1's state, as
            # the one-by-one pipeline's do, and the run goes on from there.
            (tmp_path / "c").mkdir(), (tmp_path / "s").mkdir()
            assert [s.sha256 for s in chained.states(tmp_path / "c")] == [
                s.sha256 for s in single.states(tmp_path / "s")]
            for k in (1, 2):
                _same(chained.step(Batch(train_set, order[k]), train=True, train_step=k + 1),
                      single.step(Batch(train_set, order[k]), train=True, train_step=k + 1))


class StopAfter(RecordingSink):
    """Asks for a stop once it has seen step `step`."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def should_stop(self) -> bool:
        return bool(self.steps) and self.steps[-1].step >= self.step


def test_a_stop_asked_mid_window_ends_the_run_after_the_window_sent_every_step_of_which_is_reported(
    agent: Agent
) -> None:
    addresses = _host(agent, "stopped")
    [stage_0] = [s for s in agent.registry.stages() if s.assignment.job_id == "stopped" and s.io.is_first]
    sink = StopAfter(3)
    result = train(_plan("stopped", addresses, max_steps=40), sink)
    assert result.stopped and 3 <= result.steps <= 3 + MAX_WINDOW_STEPS
    # Each window sent ran and was reported, and none went out once the stop was asked: stage 0 computed exactly the
    # steps the sink saw.
    assert [p.step for p in sink.steps] == list(range(1, result.steps + 1))
    assert stage_0.runtime.counters.samples == result.steps * BATCH
