"""The Django-free training driver: feeds a pipeline of stages over gRPC and reports progress."""

from arceus.training.driver import DriverError, train
from arceus.training.plan import (
    EpochResult,
    ProgressSink,
    RankEndpoint,
    StageEndpoint,
    StageStateFile,
    StageTiming,
    StepProgress,
    TrainPlan,
    TrainResult,
    UploadTarget,
)

__all__ = [
    "DriverError",
    "EpochResult",
    "ProgressSink",
    "RankEndpoint",
    "StageEndpoint",
    "StageStateFile",
    "StageTiming",
    "StepProgress",
    "TrainPlan",
    "TrainResult",
    "UploadTarget",
    "train",
]
