"""A progress sink for benchmarks: the time each training step ended, and nothing else."""

from __future__ import annotations

import time

from arceus.training.plan import EpochResult, StageEndpoint, StageStateFile, StepProgress, UploadTarget


class Clock:
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step(self, p: StepProgress) -> None:
        self.times.append(time.perf_counter())

    def on_epoch(self, r: EpochResult) -> None:
        pass

    def checkpoint_uploads(self, step: int, stages: list[StageEndpoint]) -> dict[int, UploadTarget]:
        return {}

    def on_checkpoint(self, step: int, epoch: int, stages: list[StageStateFile]) -> None:
        pass  # benchmarks time training steps only

    def wants_checkpoint(self) -> bool:
        return False

    def should_stop(self) -> bool:
        return False
