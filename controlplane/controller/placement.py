"""A job in the placement solver's terms: its in-flight work, its requirements and tensor-parallel split
(its layers' costs: `arceus.placement.profiles`)."""

from __future__ import annotations

import math
from typing import Any

from arceus.placement.solver import Workload
from controlplane.controller.views import Requirements, TensorParallel


def workload(
    dataset_config: dict[str, Any], micro_batches: int, schedule: str, *, optimizer: str = "adam",
    activation_checkpointing: bool = False, precision: str = "fp32", staleness: int = 0,
) -> Workload:
    """A training step's micro-batches: `micro_batches` of ceil(batch_size / micro_batches) samples, run by
    `schedule`, trained with `optimizer` (an `arceus.model.expected_state.optimizer_kind`) with or without
    activation checkpointing, computing in `precision`, with the job's `staleness`."""
    return Workload(
        math.ceil(dataset_config["batch_size"] / micro_batches), micro_batches, schedule, optimizer=optimizer,
        activation_checkpointing=activation_checkpointing, precision=precision, staleness=staleness,
    )


def requirements(config: dict[str, Any]) -> Requirements:
    """The stored (already validated) `requirements` of a job."""
    return Requirements(
        min_memory_bytes=config.get("min_memory_bytes", 0),
        device_types=tuple(config.get("device_types", ())),
        min_devices=config.get("min_devices"),
        max_devices=config.get("max_devices"),
        max_price_per_hour=config.get("max_price_per_hour"),
        owner_diversity=config.get("owner_diversity", True),
    )


def tensor_parallel_split(config: dict[str, Any]) -> TensorParallel:
    """The stored (already validated, normalised) `tensor_parallel` of a job."""
    stages = config.get("stages")
    return TensorParallel(size=config.get("size", 1), stages=None if stages is None else tuple(stages))
