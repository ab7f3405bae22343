"""A ProgressSink that keeps everything: for scripts, notebooks, tests and benchmarks that run the driver
without a control plane. Checkpoints are kept as the stages' safetensors files in a directory of its own."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from arceus.training.plan import EpochResult, StageEndpoint, StageStateFile, StepProgress, UploadTarget


class RecordingSink:
    def __init__(self, directory: Path | None = None) -> None:
        """`directory` receives the checkpoint files (None: a new temporary directory)."""
        self.directory = directory or Path(tempfile.mkdtemp(prefix="arceus-recording-"))
        self.steps: list[StepProgress] = []
        self.epochs: list[EpochResult] = []
        self.checkpoints: dict[int, list[StageStateFile]] = {}  # step -> every stage's state file

    def on_step(self, p: StepProgress) -> None:
        self.steps.append(p)

    def on_epoch(self, r: EpochResult) -> None:
        self.epochs.append(r)

    def checkpoint_uploads(self, step: int, stages: list[StageEndpoint]) -> dict[int, UploadTarget]:
        return {}  # no control plane to upload to: the driver streams every stage's state here

    def on_checkpoint(self, step: int, epoch: int, stages: list[StageStateFile]) -> None:
        kept = self.directory / f"step-{step:08d}"
        kept.mkdir(parents=True, exist_ok=True)
        files = []
        for s in stages:
            if s.path is None:
                raise ValueError(f"stage {s.index}'s state went to upload {s.upload_id}, not to a file to keep")
            files.append(replace(s, path=Path(shutil.move(s.path, kept / f"stage-{s.index}.safetensors"))))
        self.checkpoints[step] = files

    def wants_checkpoint(self) -> bool:
        return False

    def should_stop(self) -> bool:
        return False
