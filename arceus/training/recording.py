"""A ProgressSink that keeps everything in memory: for scripts, notebooks, tests and benchmarks that run
the driver without a control plane."""

from __future__ import annotations

from arceus.training.plan import EpochResult, StageTensors, StepProgress


class RecordingSink:
    def __init__(self) -> None:
        self.steps: list[StepProgress] = []
        self.epochs: list[EpochResult] = []
        self.checkpoints: dict[int, list[StageTensors]] = {}  # step -> every stage's state

    def on_step(self, p: StepProgress) -> None:
        self.steps.append(p)

    def on_epoch(self, r: EpochResult) -> None:
        self.epochs.append(r)

    def on_checkpoint(self, step: int, epoch: int, stages: list[StageTensors]) -> None:
        self.checkpoints[step] = stages

    def wants_checkpoint(self) -> bool:
        return False

    def should_stop(self) -> bool:
        return False
